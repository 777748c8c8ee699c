"""What one attention layer saw in one forward call: the statistics scorers read.

Statistics are computed lazily and memoised, only for the rows a scorer asks for (window queries,
the last query), never as an N×N matrix. A scorer declares the statistics it needs (``Scorer.needs``);
a :class:`LayerStep` built for it refuses the others, so the declaration stays true.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvsieve.attention.flash_statistics import flash_attention_and_column_sums, fused_attention_and_column_sums
from kvsieve.attention.kernel import (
    AttentionForm,
    Visibility,
    attention_and_column_maxima,
    attention_and_column_sums,
    attention_rows,
    column_maxima,
    column_sums,
    window_attention_rows,
    window_column_sums,
)
from kvsieve.cache.store import DenseView, LayerStore
from kvsieve.models.architectures import ModelInfo
from kvsieve.native import decoding_rows
from kvsieve.native.column_sums import causal_column_sums
from kvsieve.native.fused_attention import causal_attention_with_column_sums

#: Statistic names a scorer may declare in ``Scorer.needs``.
WINDOW_ROWS = "window_rows"  #: softmax rows of the last ``w`` queries
WINDOW_OUTPUTS = "window_outputs"  #: their per-head outputs ``o_t`` before ``W_O``
COLUMN_SUMS = "column_sums"  #: ``Σ_t A[t, j]`` over every query of the forward
COLUMN_MAXIMA = "column_maxima"  #: ``max_t A[t, j]`` over every query of the forward
OUTPUT_PROJECTION = "output_projection"  #: the layer's ``W_O`` weight
LAYER_INPUTS = "layer_inputs"  #: the attention-input hidden states (after the layer's norm) of the new tokens
STATISTICS = (WINDOW_ROWS, WINDOW_OUTPUTS, COLUMN_SUMS, COLUMN_MAXIMA, OUTPUT_PROJECTION, LAYER_INPUTS)

#: Side data holding how many tokens a (merged) entry stands for; attention adds ``log(count)``.
MERGE_COUNT = "merge_count"


def count_bias(counts: torch.Tensor) -> torch.Tensor:
    """The additive logit bias ``log(count)`` of merged entries (a centre of ``n`` tokens counts ``n`` times; EMS,
    Sec. 4.2), float32; counts below 1 count once."""
    return counts.float().clamp(min=1.0).log()


@dataclass(frozen=True)
class AppendedUpdate:
    """A side-data update for the forward's new entries only: ``values`` ``(batch, kv_heads, q)``, one per new
    token (padding tokens ignored), added where the store wrote them — at a decoding step one row per head,
    where a dense ``(batch, kv_heads, L)`` update would touch every held entry."""

    values: torch.Tensor


@dataclass(frozen=True)
class DeferredUpdate:
    """A side-data update for a decoding step's new entries (one per segment) computed later, with later steps' in one
    batch (:mod:`kvsieve.cache.deferred_side`): this step's ``inputs`` ``(batch, 1, ...)`` and ``compute``, mapping
    inputs ``(batch, k, ...)`` to values ``(batch, kv_heads, k, ...)`` added to the entries (as an
    :class:`AppendedUpdate`'s), the same function at every step of a layer. A store that cannot defer (its last append
    was not one entry per segment) computes it at once."""

    inputs: torch.Tensor
    compute: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerStep:
    """One forward (or one block of it) of one layer, after the new entries were appended to the store.

    ``query`` is ``(batch, q_heads, q, d)`` (post-RoPE); the queries sit at absolute slots
    ``first_position + [0, q)``; ``query_valid`` ``(batch, q)`` marks non-padding queries (None: all real).
    ``view`` is the dense view of every entry the layer holds, the new ones included. ``form`` is how the
    model turns logits into weights (``scaling``, soft-capping, sinks); statistics use it, so scorers see
    the attention the model computes. Without one, the form of ``scaling`` alone.
    """

    module: torch.nn.Module
    layer_idx: int
    info: ModelInfo
    query: torch.Tensor
    first_position: int
    query_valid: torch.Tensor | None
    store: LayerStore
    scaling: float
    sliding_window: int | None = None
    forward_index: int = 0
    layer_inputs: torch.Tensor | None = None
    #: Statistics the reading part declared (None: any).
    allowed: frozenset[str] | None = None
    form: AttentionForm | None = None
    #: The forward's 2-D padding mask ``(batch, seen + q)`` (True: a real token); None when every token is real.
    padding: torch.Tensor | None = None
    #: A probe forward (:mod:`kvsieve.engine.probe`): tokens read only to score the held entries (KVzip's
    #: context reconstruction); their own entries are dropped after it.
    probing: bool = False
    #: Statistics (tensors) and the block visibility computed once per step.
    _memo: dict[object, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.form is None:
            self.form = AttentionForm(self.scaling)

    # ------------------------------------------------------------------ basics
    @property
    def view(self) -> DenseView:
        return self.store.dense()

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    def ages(self, positions: torch.Tensor) -> torch.Tensor:
        """Tokens from each entry at ``positions`` ``(batch, heads, L)`` to the newest query, padding slots
        between them not counted (a batch that pads questions after a shared context sees each row's ages as
        the row alone would)."""
        now = self.first_position + self.q_len - 1
        age = now - positions
        if self.padding is None:
            return age
        pads = (~self.padding.to(positions.device)).long().cumsum(dim=1)  # padding slots up to each slot
        last = pads.shape[1] - 1
        at_entry = pads.gather(1, positions.clamp(0, last).reshape(positions.shape[0], -1)).view_as(positions)
        return age - (pads[:, min(now, last), None, None] - at_entry)

    def real_positions(self, slots: torch.Tensor) -> torch.Tensor:
        """Index of each slot among its row's real tokens (the slot minus the padding slots before it; the rotary
        position ``generate`` gives a left-padded row), same shape as ``slots`` whose first dimension is the
        batch. Without padding: the slots themselves."""
        if self.padding is None:
            return slots
        pads = (~self.padding.to(slots.device)).long().cumsum(dim=1)
        flat = slots.reshape(slots.shape[0], -1)
        return (flat - pads.gather(1, flat.clamp(0, pads.shape[1] - 1))).view_as(slots)

    @property
    def is_decoding(self) -> bool:
        """A single-token forward (generation step) rather than a prompt chunk."""
        return self.q_len == 1

    @property
    def kv_heads(self) -> int:
        """Heads the store holds (the model's KV heads)."""
        return self.store.heads

    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.store.heads

    @property
    def query_positions(self) -> torch.Tensor:
        if "qpos" not in self._memo:
            self._memo["qpos"] = torch.arange(
                self.first_position, self.first_position + self.q_len, device=self.query.device
            )
        return self._memo["qpos"]

    def lengths(self) -> torch.Tensor:
        """Entries held per (batch, KV head), on the entries' device."""
        if "lengths" not in self._memo:
            store = self.store
            if store.is_uniform and not store.tiered:  # every head holds the same (a Python int): no host copy
                self._memo["lengths"] = torch.full((store.batch, store.heads), store.max_length, dtype=torch.long,
                                                   device=self.query.device)
            else:
                self._memo["lengths"] = store.lengths().to(self.query.device)
        return self._memo["lengths"]

    def entry_valid(self) -> torch.Tensor:
        """``(batch, kv_heads, L)`` True for real entries of the dense view."""
        if self.view.valid is not None:
            return self.view.valid
        return torch.ones(self.view.positions.shape, dtype=torch.bool, device=self.view.positions.device)

    def bias(self) -> torch.Tensor | None:
        """Additive logit bias per held entry ``(batch, kv_heads, L)``: ``log(count)`` of merged entries; None
        while no entry was merged (every count 1: the bias would be zero everywhere)."""
        if MERGE_COUNT not in self.store.written_sides:
            return None
        counts = self.view.extras.get(MERGE_COUNT)
        if counts is None:
            return None
        if "bias" not in self._memo:
            bias = count_bias(counts)
            if self.view.valid is not None:
                bias = bias.masked_fill(~self.view.valid, 0.0)
            self._memo["bias"] = bias
        return self._memo["bias"]

    def _require(self, name: str) -> None:
        if self.allowed is not None and name not in self.allowed:
            raise RuntimeError(f"statistic {name!r} was not declared in the part's `needs` ({sorted(self.allowed)})")

    # ------------------------------------------------------------------ statistics
    def window_rows(self, window: int) -> torch.Tensor:
        """Softmax rows ``(batch, q_heads, w, L)`` of the last ``min(window, q)`` queries (float32).

        Rows of padding queries are zero.
        """
        self._require(WINDOW_ROWS)
        w = min(window, self.q_len)
        key = ("rows", w)
        if key not in self._memo:
            mask: torch.Tensor | None
            if self.is_decoding and self.sliding_window is None:
                # the newest query sees every held entry (as the engine's output mask): validity is visibility
                mask = None if self.view.valid is None else self.view.valid.unsqueeze(-2)
                rows = attention_rows(self.query[:, :, -w:], self.view.keys, mask, self.form, self.bias())
            else:  # masked where some window query cannot see (the window's own square under a causal prefill)
                rows = window_attention_rows(self.query[:, :, -w:], self.view.keys, self._window_visibility(w),
                                             self.form, self.bias())
            if self.query_valid is not None:
                rows = rows * self.query_valid[:, None, -w:, None].to(rows.dtype)
            self._memo[key] = rows
        return self._memo[key]

    def window_column_sums(self, window: int) -> torch.Tensor:
        """``Σ_t A[t, j]`` over the last ``min(window, q)`` real queries, ``(batch, q_heads, L)`` (float32): the sum of
        :meth:`window_rows` over its queries (part of that statistic), from the rows when they are computed already,
        else without holding them (:func:`~kvsieve.attention.kernel.window_column_sums`, one KV head at a time at a
        prompt forward: bit for bit the same sums)."""
        self._require(WINDOW_ROWS)
        w = min(window, self.q_len)
        key = ("window_sums", w)
        if key not in self._memo:
            if ("rows", w) in self._memo or self.is_decoding:
                self._memo[key] = self.window_rows(window).sum(dim=2)
            else:
                weight = None if self.query_valid is None else self.query_valid[:, -w:]
                self._memo[key] = window_column_sums(self.query[:, :, -w:], self.view.keys, self._window_visibility(w),
                                                     self.form, self.bias(), weight)
        return self._memo[key]

    def _window_visibility(self, w: int) -> Visibility:
        """The visibility of this forward's last ``w`` queries over the held entries."""
        return Visibility(self.first_position + self.q_len - w, self.view.positions, self.view.valid,
                          self.sliding_window)

    def window_outputs(self, window: int) -> torch.Tensor:
        """Per-query-head attention outputs before ``W_O``, ``o_t = Σ_j A[t, j] v_j``, ``(batch, q_heads, w, d)``.

        Computed in float32 from :meth:`window_rows` and the dense view's values (query head ``i`` reads
        KV head ``i // groups``), so no second attention pass; rows of padding queries give zeros.
        """
        self._require(WINDOW_OUTPUTS)
        rows = self.window_rows(window)
        key = ("outputs", rows.shape[2])
        if key not in self._memo:
            batch, q_heads, w, length = rows.shape
            values = self.view.values.float()
            if self.view.valid is not None:
                values = values.masked_fill(~self.view.valid.unsqueeze(-1), 0.0)
            kv_heads = values.shape[1]
            grouped = rows.reshape(batch, kv_heads, (q_heads // kv_heads) * w, length)
            self._memo[key] = torch.matmul(grouped, values).view(batch, q_heads, w, values.shape[-1])
        return self._memo[key]

    @property
    def _block_mask(self) -> Visibility:
        """Visibility of this forward's queries over the dense view, block by block (the blockwise passes)."""
        if "visibility" not in self._memo:
            view = self.view
            self._memo["visibility"] = Visibility(self.first_position, view.positions, view.valid,
                                                  self.sliding_window)
        return self._memo["visibility"]

    def all_column_sums(self) -> torch.Tensor:
        """``Σ_t A[t, j]`` over every (non-padding) query of this forward, ``(batch, q_heads, L)``."""
        self._require(COLUMN_SUMS)
        if "colsum" not in self._memo:
            if self.q_len == 1:
                self._memo["colsum"] = self.window_rows_unchecked(1)[:, :, 0]
            else:
                self._memo["colsum"] = column_sums(
                    self.query, self.view.keys, self._block_mask, self.form, self.query_valid, self.bias()
                )
        return self._memo["colsum"]

    def all_column_maxima(self) -> torch.Tensor:
        """``max_t A[t, j]`` over every (non-padding) query of this forward, ``(batch, q_heads, L)``."""
        self._require(COLUMN_MAXIMA)
        if "colmax" not in self._memo:
            self._memo["colmax"] = column_maxima(
                self.query, self.view.keys, self._block_mask, self.form, self.query_valid, self.bias()
            )
        return self._memo["colmax"]

    def output_with_column_sums(self) -> torch.Tensor:
        """The attention output ``(batch, q, q_heads, d)`` of this forward's queries over the dense view, from
        the same blockwise pass as :meth:`all_column_sums` (memoised here, bit-identical to computing it
        alone): one ``q·k`` pass instead of SDPA followed by a second one for the statistic. A bfloat16 causal
        prompt on a CPU with AMX tiles, or a float32 one on a CPU with AVX-512 or AVX2, takes the C pass that computes
        both from one set of exponentials (:meth:`native_output_with_column_sums`); elsewhere a bfloat16, float16 or
        float32 causal prompt on the CPU takes the flash kernel's output (SDPA's, bit for bit) and the sums from its
        log-sum-exp (:mod:`kvsieve.attention.flash_statistics`; the sums then carry that kernel's fast exponential,
        ~1e-5 relative), from the CPU's bfloat16 dot products or float32 vector code where it has them
        (:mod:`kvsieve.native.column_sums`)."""
        self._require(COLUMN_SUMS)  # refused before any work
        output = self.native_output_with_column_sums()
        if output is None:
            output = self.flash_output_with_column_sums()
        if output is None:
            return self._fused_output(COLUMN_SUMS, "colsum", attention_and_column_sums)
        return output

    def native_output_with_column_sums(self) -> torch.Tensor | None:
        """:meth:`output_with_column_sums` from the CPU's C pass, which takes each exponential once for the output and
        the sums (memoised; :mod:`kvsieve.native.fused_attention`): the same prompts as the flash route, bfloat16 on
        AMX tiles (head sizes that are multiples of 32) or float32 with AVX-512 or AVX2 (multiples of 16). Its output
        is within bfloat16 (float32) rounding of SDPA's, not SDPA's, so only under ``fuse_statistics=True``; None
        elsewhere (nothing computed)."""
        return self._prompt_route(fused_attention_and_column_sums, causal_attention_with_column_sums)

    def flash_output_with_column_sums(self) -> torch.Tensor | None:
        """:meth:`output_with_column_sums` where it is the flash kernel's output — SDPA's own on the CPU, bit for bit —
        with the sums from its log-sum-exp (memoised); None elsewhere (nothing computed): a bfloat16, float16 or
        float32 causal first prompt on the CPU, no padding, no sliding window, no soft-capping, sinks or bias."""
        return self._prompt_route(flash_attention_and_column_sums, causal_column_sums)

    def _prompt_route(self, route: Callable[..., tuple[torch.Tensor, torch.Tensor] | None], kernel: Callable[..., Any]
                      ) -> torch.Tensor | None:
        """The output of ``route`` (:mod:`kvsieve.attention.flash_statistics`'s, given the C ``kernel`` it may call)
        over the dense view, its column sums memoised; None where the route does not apply."""
        self._require(COLUMN_SUMS)
        result = route(self.query, self.view.keys, self.view.values, self._block_mask,
                       self.form if self.form is not None else self.scaling, self.query_valid, self.bias(), kernel)
        if result is None:
            return None
        self._memo["colsum"] = result[1]
        return result[0]

    def output_with_column_maxima(self) -> torch.Tensor:
        """The attention output of this forward's queries over the dense view and :meth:`all_column_maxima` (memoised)
        from one blockwise pass (KVzip's probe forwards on the CPU: the output is the probe's, never the user's)."""
        return self._fused_output(COLUMN_MAXIMA, "colmax", attention_and_column_maxima)

    def _fused_output(self, statistic: str, memo_key: str, kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                      ) -> torch.Tensor:
        """The output and ``statistic`` from one kernel pass; the statistic is memoised under ``memo_key``."""
        self._require(statistic)
        view = self.view
        output, value = kernel(self.query, view.keys, view.values, self._block_mask, self.form, self.query_valid,
                               self.bias())
        self._memo[memo_key] = value
        return output

    def decoding_output_from_row(self) -> torch.Tensor:
        """A decoding query's attention output ``(batch, 1, q_heads, d)`` from its float32 softmax row over the
        dense view (:meth:`window_rows` of one query, memoised: the row H2O and EMS accumulate, TOVA scores),
        ``P·V`` in float32, rounded to the query's dtype. Padding slots have zero probability; their values are
        zeroed too (a free row may hold anything). On the CPU (no padding query, no sliding window, no soft-capping
        or sinks) both come from one C pass over the entries in their dtype (:mod:`kvsieve.native.decoding_rows`:
        no float32 copies of the keys and values; within float32 rounding), and the row is memoised for the
        scorer."""
        assert self.q_len == 1
        if ("rows", 1) not in self._memo and self.query_valid is None and self.sliding_window is None \
                and (self.form is None or not self.form.explicit):
            # on the CPU: the output and the rows in one pass over the entries in their dtype (no float32 copies)
            view = self.view
            counts = view.extras.get(MERGE_COUNT) if MERGE_COUNT in self.store.written_sides else None
            fused = decoding_rows.attend(self.query, self.scaling, view.keys, view.values, view.valid, counts,
                                         counts=True)  # log(count) in the pass, as the every-step path takes it
            if fused is not None:
                output, self._memo[("rows", 1)] = fused
                return output
        row = self.window_rows_unchecked(1)[:, :, 0]
        values = self.view.values
        if self.view.valid is not None:
            values = values.masked_fill(~self.view.valid.unsqueeze(-1), 0.0)
        batch, q_heads, length = row.shape
        kv_heads = values.shape[1]
        grouped = row.view(batch, kv_heads, q_heads // kv_heads, length)
        # float32 product: a CPU's small bfloat16 matmul costs twice the float32 one with the conversion
        output = torch.matmul(grouped, values.float())  # (batch, kv_heads, groups, d): each KV head's group as rows
        return output.view(batch, 1, q_heads, values.shape[-1]).to(self.query.dtype)

    def window_rows_unchecked(self, window: int) -> torch.Tensor:
        allowed, self.allowed = self.allowed, None
        try:
            return self.window_rows(window)
        finally:
            self.allowed = allowed

    def output_projection(self) -> torch.Tensor:
        """The layer's ``W_O`` weight ``(hidden, q_heads·d)`` (detached)."""
        self._require(OUTPUT_PROJECTION)
        return getattr(self.module, self.info.spec.output_proj_attr).weight.detach()

    def inputs(self) -> torch.Tensor:
        """Attention-input hidden states ``(batch, q, hidden)`` of this forward's tokens (after the layer's norm)."""
        self._require(LAYER_INPUTS)
        if self.layer_inputs is None:
            raise RuntimeError("layer inputs were not captured for this forward (see kvsieve.engine.layer_inputs)")
        return self.layer_inputs

