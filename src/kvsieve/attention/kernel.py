"""The one attention kernel: outputs for prefill, decoding and blockwise blocks, and statistics for scorers.

Everything kvsieve attends with goes through here, with the same three optional inputs:

* a **visibility** mask from stored absolute positions (``pos_k ≤ pos_q``, the sliding window, real
  entries only) — stays right after eviction, unlike transformers' slot-indexed masks;
* an additive **bias** per held entry (``(batch, kv_heads, L)``), e.g. ``log(count)`` of a merged
  entry that stands for ``count`` tokens (EMS): with a bias the mask becomes a float mask;
* a **subset** of entries per query head (``(batch, q_heads, k)`` indices), for decoding-time
  selection (``exact_topk``; Quest, SparQ, HSA): only those entries are gathered and attended.

The logits are those the model attends with, described by one :class:`AttentionForm`: the model's
``scaling``, Gemma2's attention-logit **soft-capping** (``tanh(x / cap)·cap`` of the scaled logits, before
the mask and the bias) and GPT-OSS's learned **sinks** (one logit per query head that joins every
softmax as an extra column and is then dropped, so a row sums to less than one). Outputs use SDPA
underneath (transformers' ``sdpa_attention_forward``, so GQA is handled as transformers does) when the
form is plain; SDPA can do neither soft-capping nor sinks, so with either the output is computed
explicitly (:func:`explicit_attention`, the same operations in the same order as the modeling file's
eager attention). Statistics (:func:`attention_rows`, :func:`column_sums`) compute explicit softmax rows
in float32 with the same form, only for the queries a scorer needs, blockwise, never an N×N matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvsieve.transformers_adapter import sdpa_attention

#: The fewest queries per block when summing attention columns over many queries off the CPU (see
#: :func:`query_block_rows`; on the CPU blocks are smaller, sized to the cache).
QUERY_BLOCK = 256
#: Bytes of float32 logits one CPU block aims at, and the bounds on its rows (:func:`query_block_rows`).
CPU_BLOCK_BYTES = 24 * 2**20
MIN_CPU_BLOCK, MAX_CPU_BLOCK = 16, 64
#: Bytes of float32 logits one block aims at off the CPU (a GPU): the block's softmax and products hold about
#: three times this at once (~1.5 GiB). On an H200 (the default model's shape, 4k prompt) H2O's prefill took 1.65×
#: SnapKV's with 512 MiB blocks, 2.28× with 128 MiB, 3.50× with 256-query blocks (``statistics_prefill_cuda_*.json``).
DEVICE_BLOCK_BYTES = 512 * 2**20


@dataclass(frozen=True, eq=False)
class AttentionForm:
    """How one attention layer turns ``q·k`` into weights: ``softmax([cap(q·k·scaling) + mask, sinks])``.

    ``softcap``: Gemma2's ``attn_logit_softcapping`` (None: none); ``sinks``: GPT-OSS's learned sink logit
    per query head ``(q_heads,)`` (None: none). The model passes both to the attention function at every
    call (``softcap=``, ``s_aux=``).
    """

    scaling: float
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def explicit(self) -> bool:
        """Whether outputs need the explicit path (SDPA cannot soft-cap or add sinks)."""
        return self.softcap is not None or self.sinks is not None

    def serves_decoding(self, q_len: int, sliding_window: int | None) -> bool:
        """Whether a call of ``q_len`` queries is a decoding call this form lets SDPA serve (one query, no sliding
        window, no soft-capping or sinks): the calls the engine's decoding route takes (``Engine.attend_decoding``)."""
        return q_len == 1 and sliding_window is None and not self.explicit

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Soft-capped logits ``tanh(x / cap)·cap`` (the modeling files' order of operations); unchanged without."""
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


def as_form(form: AttentionForm | float) -> AttentionForm:
    """A plain scaling is the form without soft-capping or sinks."""
    return form if isinstance(form, AttentionForm) else AttentionForm(float(form))


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Float32 softmax over the last dim; with ``sinks`` (broadcastable to ``logits[..., :1]``) each row gets
    one more column, its sink logit, which takes its share of the mass and is dropped (GPT-OSS)."""
    if sinks is None:
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    sink = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]


def explicit_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    form: AttentionForm,
) -> torch.Tensor:
    """Attention output ``(batch, q, q_heads, d)`` computed explicitly, as a modeling file's eager attention.

    ``keys``/``values`` ``(batch, kv_heads, n, d)`` are repeated per query head (``repeat_kv``);
    ``mask`` is None (every key visible), boolean (True: visible) or an additive float mask, broadcastable
    to ``(batch, q_heads, q, n)``. Logits ``q·k·scaling`` are soft-capped, masked, soft-maxed in float32
    with the sinks, and cast back to the values' dtype.
    """
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    logits = form.cap(torch.matmul(query, keys.transpose(2, 3)) * form.scaling)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    sinks = None if form.sinks is None else form.sinks.reshape(1, -1, 1, 1)
    probs = softmax_with_sinks(logits, sinks).to(values.dtype)
    return torch.matmul(probs, values).transpose(1, 2).contiguous()


#: On the CPU a decoding call over one KV head holding at least this many entries is split across threads
#: (:func:`split_decoding_attention`). Measured on 2 cores (bf16, 3 query rows of 64) with a decoding step's matrix
#: products run between calls, as in a model (one call vs split, µs): 270 vs 315 at 8k entries, 414 vs 351 at 12k,
#: 741 vs 580 at 24k; back-to-back calls alone (warm threads and caches) had put the break-even near 1k and made
#: the split 1.35× faster at 4k, which a model's step does not see (KVzip's 3,516-entry head: 0.52 → 0.34 ms).
SPLIT_DECODING_LENGTH = 10240
#: Entries each part of a split call holds at least.
SPLIT_PART_LENGTH = 1024


def _flash_with_logsumexp() -> Callable[..., tuple[torch.Tensor, ...]] | None:
    """PyTorch's CPU flash-attention operator, which returns the log-sum-exp with the output (what
    ``scaled_dot_product_attention`` dispatches to on the CPU; private: ``aten::_scaled_dot_product_flash_\
attention_for_cpu(query, key, value, dropout_p, is_causal, *, attn_mask, scale) -> (output, logsumexp)``,
    checked with the pinned torch 2.13; looked up at call time, so a build without it — or one whose operator
    returns something else — costs the split, not a failure). None where a build lacks it: callers then make
    one call."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def splits_decoding(entries: int, device: torch.device) -> bool:
    """Whether :func:`split_decoding_attention` cuts a head of ``entries`` entries on ``device`` across the threads
    (a CPU, several threads, at least :data:`SPLIT_DECODING_LENGTH` entries and the operator it needs)."""
    return (device.type == "cpu" and torch.get_num_threads() >= 2 and entries >= SPLIT_DECODING_LENGTH
            and _flash_with_logsumexp() is not None)


def split_decoding_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
                             ) -> torch.Tensor | None:
    """Decoding attention of ``query`` ``(rows, d)`` (one KV head's query rows) over ``keys``/``values``
    ``(n, d)`` (contiguous rows), split across the CPU's threads; None when it would not pay (fewer than
    :data:`SPLIT_DECODING_LENGTH` entries, one thread, not on the CPU, or no operator returning the log-sum-exp).

    A single call over one head runs on one thread (PyTorch's CPU kernel splits work by batch item, head and
    query block; a decoding head has one of each). The entries are cut into ``parts`` equal runs, viewed as
    ``parts`` batch items of one call (no copy), each giving its output and log-sum-exp; the few entries left
    over (fewer than ``parts``) are attended explicitly in float32; the partial outputs are combined with
    weights ``softmax(log-sum-exps)``, as split-K attention kernels do. The same attention as one call, rounded
    differently (float32 combination, one rounding to the model dtype; ``test_length_groups.py``).
    """
    n, dim = keys.shape
    operator = _flash_with_logsumexp()
    if not splits_decoding(n, query.device) or operator is None:
        return None
    threads = torch.get_num_threads()
    parts = max(2, min(threads, n // SPLIT_PART_LENGTH))
    width = n // parts
    body = parts * width
    rows = query.shape[0]
    grouped = query.view(1, 1, rows, dim).expand(parts, 1, rows, dim)
    try:
        output, logsumexp = operator(grouped, keys[:body].view(parts, 1, width, dim),
                                     values[:body].view(parts, 1, width, dim), scale=scale)[:2]
    except (RuntimeError, TypeError, ValueError):  # another signature in another torch: one call instead
        return None
    if logsumexp.shape != (parts, 1, rows):
        return None
    outputs, weights = output.view(parts, rows, dim).float(), logsumexp.view(parts, rows)
    if body < n:  # the last n − body entries (fewer than ``parts``), explicitly
        logits = torch.matmul(query.float(), keys[body:].float().transpose(0, 1)) * scale
        rest = torch.matmul(torch.softmax(logits, dim=-1), values[body:].float())
        outputs = torch.cat([outputs, rest.unsqueeze(0)])
        weights = torch.cat([weights, torch.logsumexp(logits, dim=-1).unsqueeze(0)])
    share = torch.softmax(weights, dim=0).unsqueeze(-1)
    return (outputs * share).sum(dim=0).to(query.dtype)


def causal_mask(q_len: int, device: torch.device) -> torch.Tensor:
    """Boolean ``(1, 1, q, q)`` causal mask of a prompt attending to itself."""
    return torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()[None, None]


def any_along(mask: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``mask.any(dim)`` for a bool mask, as a byte ``amax`` (on CPU, ``torch.any`` over an axis of a large
    bool tensor is ~50× slower than the same reduction on its bytes)."""
    return mask.view(torch.uint8).amax(dim=dim, keepdim=keepdim).bool()


def all_along(mask: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``mask.all(dim)`` for a bool mask, as a byte ``amin`` (see :func:`any_along`)."""
    return mask.view(torch.uint8).amin(dim=dim, keepdim=keepdim).bool()


def some_row_sees_nothing(mask: torch.Tensor) -> bool:
    """Whether any query row of a visibility mask has no visible key (its softmax would be NaN); one host read."""
    return not bool(all_along(any_along(mask, -1).flatten(), 0))


def visibility_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean ``(batch, kv_heads, q, n)`` mask: key visible iff ``pos_k ≤ pos_q`` (and inside the window).

    ``key_positions`` is ``(batch, kv_heads, n)``; ``key_valid`` marks real (non-padding) entries.
    Positions are absolute slots in the token stream, so the mask stays right after eviction.
    """
    qp = query_positions.view(1, 1, -1, 1)
    kp = key_positions.unsqueeze(-2)
    mask = kp <= qp
    if sliding_window is not None:
        mask = mask & (qp - kp < sliding_window)
    if key_valid is not None:
        mask = mask & key_valid.unsqueeze(-2)
    return mask


@dataclass(frozen=True, eq=False)
class Visibility:
    """The visibility of a forward's queries over held entries, block by block, for the blockwise passes.

    Queries are the consecutive positions ``first_query … first_query + q − 1`` (a forward's tokens); keys are
    held entries with ``key_positions`` ``(batch, kv_heads, n)``, ``key_valid`` (real entries; None: all) and an
    optional sliding window. Calling it with ``(lo, hi)`` gives :func:`visibility_mask` of queries
    ``lo … hi − 1``. :meth:`bounds` finds a block's last visible column and first column some query cannot see
    from one comparison per column (``O(n)``, not the ``O(q·n)`` of reducing the block's mask), so under a
    causal prefill only the block's diagonal square is ever masked (:meth:`region`).
    """

    first_query: int
    key_positions: torch.Tensor
    key_valid: torch.Tensor | None = None
    sliding_window: int | None = None

    def query_positions(self, lo: int, hi: int) -> torch.Tensor:
        return torch.arange(self.first_query + lo, self.first_query + hi, device=self.key_positions.device)

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        return visibility_mask(self.query_positions(lo, hi), self.key_positions, self.key_valid, self.sliding_window)

    def region(self, lo: int, hi: int, start: int, stop: int) -> torch.Tensor:
        """The mask of queries ``lo … hi − 1`` over columns ``start … stop − 1`` only."""
        valid = None if self.key_valid is None else self.key_valid[..., start:stop]
        return visibility_mask(self.query_positions(lo, hi), self.key_positions[..., start:stop], valid,
                               self.sliding_window)

    def bounds(self, lo: int, hi: int) -> tuple[int, int]:
        """``(limit, first_hidden)`` of queries ``lo … hi − 1``: one past the last column some query sees, and
        the first column some query cannot see (``n`` if none); one host read."""
        newest, oldest = self.first_query + hi - 1, self.first_query + lo
        positions = self.key_positions.flatten(0, -2)
        seen = positions <= newest  # some query of the block sees the entry ...
        everyone = positions <= oldest  # ... every query does
        if self.sliding_window is not None:
            seen = seen & (oldest - positions < self.sliding_window)
            everyone = everyone & (newest - positions < self.sliding_window)
        if self.key_valid is not None:
            valid = self.key_valid.flatten(0, -2)
            seen, everyone = seen & valid, everyone & valid
        return _column_bounds(any_along(seen, 0), all_along(everyone, 0))


def _column_bounds(seen: torch.Tensor, everyone: torch.Tensor) -> tuple[int, int]:
    """One past the last True of ``seen`` and the first False of ``everyone`` (``n`` if none), one host read."""
    index = torch.arange(seen.shape[0], device=seen.device)
    bounds = torch.stack([
        torch.where(seen, index, -1).max(), torch.where(everyone, seen.shape[0], index).min(),
    ]).tolist()
    return bounds[0] + 1, bounds[1]


def output_mask(
    query_positions: Callable[[], torch.Tensor],
    key_positions: Callable[[], torch.Tensor],
    key_valid: torch.Tensor | None,
    sliding_window: int | None,
    groups: int,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    newest_query: bool = False,
) -> torch.Tensor | None:
    """The SDPA mask ``(batch, q_heads, q, n)`` for attending to held entries; None when all are visible.

    ``query_positions``/``key_positions`` are read only when needed (callables), so a decoding step
    of a ragged layer gathers no positions. ``newest_query``: a single decoding query at the newest
    position, which sees every held entry, so only validity (and the sliding window) matter. A query that
    would see nothing (a padding query) sees every real entry instead, so no row is empty (its output is
    discarded). With ``bias`` the mask is float: ``bias`` where visible, ``-inf`` elsewhere.
    """
    if newest_query and key_valid is None and sliding_window is None:
        if bias is None:
            return None
        return bias.unsqueeze(-2).to(dtype).repeat_interleave(groups, dim=1)
    if newest_query and sliding_window is None:
        assert key_valid is not None  # every held entry is at or before the newest query: validity is visibility
        mask = key_valid.unsqueeze(-2)
        if bias is not None:
            mask = torch.where(mask, bias.unsqueeze(-2).to(dtype), torch.tensor(float("-inf"), dtype=dtype))
        return mask.repeat_interleave(groups, dim=1)
    mask = visibility_mask(query_positions(), key_positions(), key_valid, sliding_window)
    empty_row = ~any_along(mask, -1, keepdim=True)
    fallback = empty_row if key_valid is None else empty_row & key_valid.unsqueeze(-2)
    mask = mask | fallback
    if bias is not None:
        mask = torch.where(mask, bias.unsqueeze(-2).to(dtype), torch.tensor(float("-inf"), dtype=dtype))
    return mask.repeat_interleave(groups, dim=1)


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    form: AttentionForm | float,
    subset: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    blend: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention output ``(batch, q, q_heads, d)`` of ``query`` over ``keys``/``values`` ``(batch, kv_heads, n, d)``.

    Without ``subset``: SDPA with ``mask`` (from :func:`output_mask`). With ``subset`` ``(batch, q_heads, k)``
    (single decoding query): each query head attends to its ``k`` entries only, gathered without
    repeating the unselected ones; ``bias`` and ``key_valid`` (``(batch, kv_heads, n)``) apply to them.
    ``blend`` ``(weight (batch, q_heads), fallback (batch, q_heads, d))`` (subset only) returns
    ``weight · output + (1 − weight) · fallback`` (SparQ's mean-value mix). ``form`` (or a plain scaling):
    with soft-capping or sinks the output is computed by :func:`explicit_attention` instead of SDPA.
    """
    form = as_form(form)
    scaling = form.scaling
    if subset is None:
        if form.explicit:
            return explicit_attention(query, keys, values, mask, form)
        if keys.shape[1] == query.shape[1] and getattr(module, "num_key_value_groups", 1) != 1:
            # keys already stored per query head (``expand_gqa``): transformers' wrapper would repeat them again
            out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
            return out.transpose(1, 2).contiguous()
        return sdpa_attention(module, query, keys, values, mask, scaling)
    batch, q_heads, _, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    k = subset.shape[-1]
    head_of = torch.arange(q_heads, device=query.device) // groups
    base = (torch.arange(batch, device=query.device)[:, None] * kv_heads + head_of[None, :]) * length
    flat = (base[..., None] + subset).reshape(-1)
    sub_keys = keys.reshape(-1, dim).index_select(0, flat).view(batch, q_heads, k, dim)
    sub_values = values.reshape(-1, dim).index_select(0, flat).view(batch, q_heads, k, dim)
    sub_mask = None
    if bias is not None or key_valid is not None:
        sub_mask = torch.zeros(batch, q_heads, 1, k, dtype=query.dtype, device=query.device)
        if bias is not None:
            sub_mask = sub_mask + bias.reshape(-1).index_select(0, flat).view(batch, q_heads, 1, k).to(query.dtype)
        if key_valid is not None:
            valid = key_valid.reshape(-1).index_select(0, flat).view(batch, q_heads, 1, k)
            sub_mask = sub_mask.masked_fill(~valid, float("-inf"))
    # keys are already per query head: plain SDPA (transformers' wrapper would repeat them per group again)
    if form.explicit:
        output = explicit_attention(query, sub_keys, sub_values, sub_mask, form)
    else:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, sub_keys, sub_values, attn_mask=sub_mask, scale=scaling
        ).transpose(1, 2).contiguous()
    if blend is not None:
        weight = blend[0].to(output.dtype)[:, None, :, None]
        output = weight * output + (1.0 - weight) * blend[1].to(output.dtype)[:, None]
    return output


def _grouped_logits(scaled_query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q·k`` logits ``(batch, kv_heads, groups, q, n)`` for GQA without repeating keys, from the query already
    scaled (scale the small side) and both in float32."""
    batch, q_heads, q_len, dim = scaled_query.shape
    kv_heads = keys.shape[1]
    grouped = scaled_query.reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)
    logits = torch.matmul(grouped, keys.transpose(-1, -2))
    return logits.view(batch, kv_heads, q_heads // kv_heads, q_len, keys.shape[2])


def attention_logits(
    query: torch.Tensor, keys: torch.Tensor, form: AttentionForm | float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Float32 logits ``(batch, kv_heads, groups, q, n)``: scaled, soft-capped, then the per-entry ``bias`` added."""
    form = as_form(form)
    logits = form.cap(_grouped_logits(query.float() * form.scaling, keys.float()))
    if bias is not None:
        logits = logits + bias.float()[:, :, None, None, :]
    return logits


def _grouped_sinks(form: AttentionForm, kv_heads: int) -> torch.Tensor | None:
    """The sink logits laid out like :func:`attention_logits` ``(1, kv_heads, groups, 1, 1)``, float32."""
    if form.sinks is None:
        return None
    return form.sinks.detach().float().reshape(1, kv_heads, -1, 1, 1)


def attention_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    form: AttentionForm | float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention ``(batch, q_heads, q, n)`` in float32 of ``query`` over ``keys``.

    ``mask`` (broadcastable to ``(batch, kv_heads, q, n)``) comes from :func:`visibility_mask`; None: every
    key is visible (a decoding query over a cache without padding). Rows with no visible key (padding
    queries) are all zero. ``form``: soft-capping and sinks as the model attends (with sinks a row sums
    to less than one: the sink's share is dropped).
    """
    form = as_form(form)
    batch, q_heads, q_len, _ = query.shape
    logits = attention_logits(query, keys, form, bias)
    if mask is not None:
        logits.masked_fill_(~mask.unsqueeze(2), float("-inf"))
    probs = softmax_with_sinks(logits, _grouped_sinks(form, keys.shape[1]))
    if mask is not None and some_row_sees_nothing(mask):  # such a row is NaN after softmax
        probs = torch.nan_to_num(probs, nan=0.0)
    return probs.view(batch, q_heads, q_len, keys.shape[2])


def window_attention_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    visibility: Visibility,
    form: AttentionForm | float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention_rows` of a forward's last queries (``query`` ``(batch, q_heads, w, d)``, consecutive positions
    from ``visibility.first_query``), masked as the blockwise passes mask a block (:func:`_block_visibility`): columns
    no query sees are ``-inf`` by one fill, and only the columns some query cannot see (under a causal prefill, the
    window's own ``w × w`` square) are compared and masked, instead of building, inverting and applying a ``w × n``
    mask (4k prompt, 32-query window, bf16 keys: 6.1 → 5.8 ms per layer with a model step's matrix products between
    calls). The same probabilities bit for bit (the same logits get ``-inf``). On the CPU computed in the chunks of
    :func:`window_column_sums` (:data:`WINDOW_CHUNK_BYTES`), each chunk's logits and softmax in a core's cache and then
    copied into the rows (the same operations on each chunk: the same rows bit for bit; 5.9 → 3.0 ms timed alone)."""
    form = as_form(form)
    batch, q_heads, w, _ = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    out = None
    for bs, kv, probs in _window_chunks(query, keys, visibility, form, bias):
        if probs.shape[:2] == (batch, kv_heads):  # one chunk (off the CPU, or one head and row): no copy
            return probs.view(batch, q_heads, w, n)
        if out is None:
            out = torch.empty(batch, kv_heads, q_heads // kv_heads, w, n, dtype=torch.float32, device=query.device)
        out[bs, kv] = probs
    assert out is not None
    return out.view(batch, q_heads, w, n)


def _window_probs(
    scaled: torch.Tensor,
    keys: torch.Tensor,
    form: AttentionForm,
    bias: torch.Tensor | None,
    sinks: torch.Tensor | None,
    bounds: tuple[int, int, torch.Tensor | None, bool],
) -> torch.Tensor:
    """Float32 probabilities ``(batch, kv_heads, groups, w, n)`` of the scaled window queries over ``keys`` (as
    :func:`attention_rows` computes them), masked by :func:`_block_visibility`'s ``bounds`` of those heads."""
    limit, first_hidden, hidden, sees_nothing = bounds
    logits = form.cap(_grouped_logits(scaled, keys.float()))
    if bias is not None:
        logits = logits + bias.float()[:, :, None, None, :]
    if limit < keys.shape[2]:
        logits[..., limit:] = float("-inf")
    if hidden is not None:
        logits[..., first_hidden:limit].masked_fill_(hidden.unsqueeze(2), float("-inf"))
    probs = softmax_with_sinks(logits, sinks)
    if sees_nothing or limit == 0:  # a row with no visible key is NaN after softmax: it attends to nothing
        probs = torch.nan_to_num(probs, nan=0.0)
    return probs


#: Float32 logits per chunk of :func:`window_column_sums` on the CPU (one KV head's group, as many batch rows as fit):
#: a chunk's logits, softmax and sum stay in a core's cache instead of going through memory as one ``w × n`` block
#: of every head (4k prompt, 32-query window, 9 query / 3 KV heads, bf16 keys: 6.0 → 2.0 ms per layer timed alone with a
#: matrix product between calls; inside the default model's prefill SnapKV's scoring went 132 → 111 ms per 4k prompt).
WINDOW_CHUNK_BYTES = 2 << 20


def _window_chunks(
    query: torch.Tensor,
    keys: torch.Tensor,
    visibility: Visibility,
    form: AttentionForm,
    bias: torch.Tensor | None,
) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """:func:`_window_probs` of a forward's last queries, chunk by chunk: ``(batch rows, KV heads, probabilities)``, the
    probabilities ``(rows, heads, groups, w, n)``. On the CPU one KV head's group and as many batch rows as
    :data:`WINDOW_CHUNK_BYTES` of logits hold; elsewhere (each chunk costs kernel launches) one chunk of everything."""
    batch, q_heads, w, _ = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    limit, first_hidden, hidden, sees_nothing = _block_visibility(visibility, 0, w)
    sinks = _grouped_sinks(form, kv_heads)
    scaled = query.float() * form.scaling
    if query.device.type == "cpu":
        heads, rows = 1, max(1, WINDOW_CHUNK_BYTES // (groups * w * n * 4))
    else:
        heads, rows = kv_heads, batch
    for h in range(0, kv_heads, heads):
        for b in range(0, batch, rows):
            kv, bs = slice(h, h + heads), slice(b, b + rows)
            bounds = (limit, first_hidden, None if hidden is None else hidden[bs, kv], sees_nothing)
            yield bs, kv, _window_probs(scaled[bs, h * groups : (h + heads) * groups], keys[bs, kv], form,
                                        None if bias is None else bias[bs, kv], None if sinks is None else sinks[:, kv],
                                        bounds)


def window_column_sums(
    query: torch.Tensor,
    keys: torch.Tensor,
    visibility: Visibility,
    form: AttentionForm | float,
    bias: torch.Tensor | None = None,
    query_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_t w_t · A[t, j]`` over a forward's last queries ``(batch, q_heads, n)`` (SnapKV's vote): the sum over the
    window of :func:`window_attention_rows` (``query_weight`` ``(batch, w)`` zeroes padding queries), computed one KV
    head's group (and, on the CPU, a cache-sized run of batch rows: :data:`WINDOW_CHUNK_BYTES`) at a time with the
    same operations, so bit for bit the sum of the rows (tested) without holding them all."""
    form = as_form(form)
    batch, q_heads = query.shape[:2]
    kv_heads, n = keys.shape[1], keys.shape[2]
    out = torch.empty(batch, kv_heads, q_heads // kv_heads, n, dtype=torch.float32, device=query.device)
    for bs, kv, probs in _window_chunks(query, keys, visibility, form, bias):
        if query_weight is not None:
            probs = probs * query_weight[bs, None, None, :, None].to(probs.dtype)
        out[bs, kv] = probs.sum(dim=3)
    return out.view(batch, q_heads, n)


def column_sums(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | Callable[[int, int], torch.Tensor],
    form: AttentionForm | float,
    query_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_t w_t · A[t, j]`` over all queries ``t``, shape ``(batch, q_heads, n)``, computed blockwise.

    ``mask`` is the visibility ``(batch, kv_heads, q, n)``, or a function ``(lo, hi)`` → the mask of queries
    ``lo … hi − 1`` (so the whole ``q × n`` mask is never built).
    ``query_weight`` ``(batch, q)`` zeroes padding queries (None: all weigh 1). Each block of queries
    only reads the keys up to the last one any of its queries can see (under a causal prefill, about
    half the work); the keys past it would only add exact zeros. Only the columns that some query of
    the block cannot see are masked (under a causal prefill, the block's own diagonal square), which
    gives the same softmax as masking every column (sinks are one more column every query sees).
    """
    return _blockwise(query, keys, None, mask, form, query_weight, bias)[1]


def column_maxima(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | Callable[[int, int], torch.Tensor],
    form: AttentionForm | float,
    query_valid: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``max_t A[t, j]`` over all (non-padding) queries ``t``, shape ``(batch, q_heads, n)``, float32, computed in
    blocks of queries (:func:`query_block_rows`; ``mask(lo, hi)``: the visibility of queries ``lo … hi − 1``), so the
    whole ``q × n`` attention is never held (KVzip's importance: the most attention an entry receives).
    Same blocks, cropping and masking as :func:`column_sums`; a padding query (``query_valid`` False) counts
    as attending to nothing."""
    return _blockwise(query, keys, None, mask, form, _as_weight(query_valid), bias, reduce="max")[1]


def attention_and_column_maxima(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | Callable[[int, int], torch.Tensor],
    form: AttentionForm | float,
    query_valid: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output ``(batch, q, q_heads, d)`` **and** :func:`column_maxima` from one pass (KVzip's probe
    forwards on the CPU: the output then costs one ``P·V`` per block instead of a second, masked SDPA pass)."""
    output, best = _blockwise(query, keys, values, mask, form, _as_weight(query_valid), bias, reduce="max")
    assert output is not None
    return output, best


def _as_weight(query_valid: torch.Tensor | None) -> torch.Tensor | None:
    """Padding flags ``(batch, q)`` as the 0/1 query weights of :func:`_blockwise` (None: every query counts)."""
    return None if query_valid is None else query_valid.to(torch.float32)


def attention_and_column_sums(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | Callable[[int, int], torch.Tensor],
    form: AttentionForm | float,
    query_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output ``(batch, q, q_heads, d)`` (values' dtype) **and** :func:`column_sums` from one pass.

    The same blocks, logits and float32 probabilities as :func:`column_sums` (so the sums are bit-identical to
    it) also give each block's output ``P·V`` — the statistic H2O and EMS accumulate costs no second ``q·k``
    pass (the paper of EMS fuses it into the attention kernel the same way). Float32 values give the float32
    product; bfloat16/float16 values multiply the probabilities rounded to their dtype with float32
    accumulation, as SDPA's CPU kernel and FlashAttention do (see :func:`_blockwise`). Queries that see no
    entry (padding) get a zero output. Against SDPA's output on the same entries the result differs by float
    rounding only (``test_kernel_statistics.py``: float32 within 1e-5 of the float64 reference; bfloat16 no
    further from the exact result than SDPA's own output, within a few units in the last place).
    """
    output, total = _blockwise(query, keys, values, mask, form, query_weight, bias)
    assert output is not None
    return output, total


def query_block_rows(batch: int, q_heads: int, n: int, device: torch.device) -> int:
    """Queries per block of the blockwise passes over ``n`` entries.

    On the CPU a block's float32 logits ``(batch, q_heads, rows, n)`` are kept near :data:`CPU_BLOCK_BYTES`
    (the largest power of two of rows that fits, between 16 and 64), so the logits, their softmax and
    the ``P·V`` product stay in the cache: measured at 1k–8k entries, batch 1–8, 9 query heads, this is
    1.5–2× faster than 256-row blocks (``benchmarks/statistics_prefill.py``). Elsewhere (a GPU) each block
    costs one host read and a dozen kernel launches, so blocks are as large as :data:`DEVICE_BLOCK_BYTES` of
    logits allow (a power of two of rows), never fewer than :data:`QUERY_BLOCK` rows.
    """
    row_bytes = max(1, batch * q_heads * n * 4)
    if device.type != "cpu":
        return max(QUERY_BLOCK, 1 << max(0, int(DEVICE_BLOCK_BYTES // row_bytes).bit_length() - 1))
    rows = 1 << max(0, int(CPU_BLOCK_BYTES // row_bytes).bit_length() - 1)
    return max(MIN_CPU_BLOCK, min(MAX_CPU_BLOCK, rows))


def _block_visibility(
    mask: torch.Tensor | Callable[[int, int], torch.Tensor], lo: int, hi: int
) -> tuple[int, int, torch.Tensor | None, bool]:
    """For queries ``lo … hi − 1``: one past the last column some query sees (``limit``), the first column some
    query cannot see (``first_hidden``), the hidden columns ``first_hidden … limit − 1`` (None if none) and
    whether some query sees no column at all (its softmax row would be NaN)."""
    if isinstance(mask, Visibility):
        limit, first_hidden = mask.bounds(lo, hi)
        if first_hidden >= limit:
            return limit, first_hidden, None, False
        region = mask.region(lo, hi, first_hidden, limit)
        # every query sees the columns before ``first_hidden``: only a block hiding column 0 can blind a query
        return limit, first_hidden, ~region, first_hidden == 0 and some_row_sees_nothing(region)
    block_mask = mask(lo, hi) if callable(mask) else mask[:, :, lo:hi]
    columns = block_mask.flatten(0, -2)
    limit, first_hidden = _column_bounds(any_along(columns, 0), all_along(columns, 0))
    if first_hidden >= limit:
        return limit, first_hidden, None, False
    return limit, first_hidden, ~block_mask[..., first_hidden:limit], some_row_sees_nothing(block_mask[..., :limit])


def _blockwise(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor | Callable[[int, int], torch.Tensor],
    form: AttentionForm | float,
    query_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    reduce: str = "sum",
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Column sums (``reduce="sum"``) or maxima (``"max"``; probabilities are non-negative, so a zero start and
    zero-weighted padding queries change nothing) and, with ``values``, the output: see :func:`column_sums`,
    :func:`column_maxima` and :func:`attention_and_column_sums`.

    Logits and probabilities are float32. The output's ``P·V`` follows SDPA's CPU kernel and FlashAttention:
    float32 values multiply float32 probabilities; bfloat16/float16 values multiply the probabilities rounded
    to their dtype, accumulated in float32 by the matrix product and rounded once (5–6× faster than a float32
    product on CPUs with native bfloat16). Column sums are ``w·P`` (``w``: the query weights) as one product.
    """
    form = as_form(form)
    sinks = _grouped_sinks(form, keys.shape[1])
    batch, q_heads, q_len, _ = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    total = torch.zeros(batch, kv_heads, groups, n, dtype=torch.float32, device=query.device)
    output = None
    if values is not None:
        reduced = values.dtype in (torch.bfloat16, torch.float16)
        values = values if reduced else values.float()  # once per call, not per block
        output = torch.empty(batch, kv_heads, groups, q_len, values.shape[-1], dtype=values.dtype,
                             device=query.device)
    keys = keys.float()
    scaled = query.float() * form.scaling  # scale the small side, once
    rows = query_block_rows(batch, q_heads, n, query.device)
    for lo in range(0, q_len, rows):
        hi = min(lo + rows, q_len)
        limit, first_hidden, hidden, sees_nothing = _block_visibility(mask, lo, hi)
        if limit == 0:
            if output is not None:
                output[:, :, :, lo:hi] = 0
            continue
        logits = form.cap(_grouped_logits(scaled[:, :, lo:hi], keys[:, :, :limit]))
        if bias is not None:
            logits = logits + bias[..., :limit].float()[:, :, None, None, :]
        if hidden is not None:
            logits[..., first_hidden:limit].masked_fill_(hidden.unsqueeze(2), float("-inf"))
        probs = softmax_with_sinks(logits, sinks)
        if sees_nothing:
            probs = torch.nan_to_num(probs, nan=0.0)  # a query that sees nothing (padding) adds nothing
        if output is not None and values is not None:  # (b, kv, g·q, n) @ (b, kv, n, d): no broadcast copies
            flat = probs.reshape(batch, kv_heads, groups * (hi - lo), limit).to(values.dtype)
            block = torch.matmul(flat, values[:, :, :limit])
            output[:, :, :, lo:hi] = block.view(batch, kv_heads, groups, hi - lo, -1)
        if reduce == "max":
            if query_weight is not None:
                probs = probs * query_weight[:, None, None, lo:hi, None].to(probs.dtype)
            total[..., :limit] = torch.maximum(total[..., :limit], probs.amax(dim=3))
        else:
            weight = (torch.ones(1, 1, 1, 1, hi - lo, device=query.device) if query_weight is None
                      else query_weight[:, None, None, None, lo:hi].to(torch.float32))
            total[..., :limit] += torch.matmul(weight, probs).squeeze(3)
    total = total.view(batch, q_heads, n)
    if output is None:
        return None, total
    out = output.view(batch, q_heads, q_len, -1).transpose(1, 2)
    return out.to(query.dtype).contiguous(), total
