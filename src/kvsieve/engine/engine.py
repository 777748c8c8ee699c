"""The engine: one owner of append → attend → observe → plan → act for a cache.

Per layer and forward call (from the registered attention function):

1. **append** the new, non-padding entries to the layer's store (absolute positions);
2. **attend** with the one kernel (:mod:`kvsieve.attention.kernel`): plain SDPA on a layer's first
   prompt (bit-exact with transformers), otherwise over the held entries with visibility from stored
   positions, the merge-count bias, and — at decoding — the selector's subset;
3. **observe**: the scorer's side-data updates (H2O's accumulated attention);
4. **plan** when the schedule fires: nominal budgets → scores → counts → the action's plan. A
   layer-scope allocator plans right away; a global one gets every managed layer's scores and plans
   once after the last managed layer of the forward (nothing is held longer than the forward);
5. **act**: the action executes the plan on the store.

Under the ``blockwise`` schedule a long forward is processed in blocks of ``block_size`` queries per
layer, each block going through steps 1–5; block ``i`` of layer ``l`` depends only on layer ``l``'s
cache after block ``i - 1`` and on layer ``l - 1``'s output for block ``i``, so this is the same
computation as feeding the model one block at a time.

The engine never imports the cache module: layers are duck-typed (:class:`LayerState`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

from kvsieve.attention.kernel import AttentionForm, attend, causal_mask, output_mask
from kvsieve.attention.masks import dense_causal_mask, padding_from_mask
from kvsieve.cache.store import LayerStore
from kvsieve.core.plan import Plan
from kvsieve.core.selection import Selection
from kvsieve.core.step import LAYER_INPUTS, LayerStep
from kvsieve.engine.row_groups import select_by_row
from kvsieve.models.architectures import ModelInfo
from kvsieve.policies.policy import Policy
from kvsieve.transformers_adapter import sdpa_attention


class LayerState(Protocol):
    """What the engine needs from a cache layer (``kvsieve.engine.kv_cache.KVLayer``)."""

    layer_idx: int
    left_alone: bool
    store: LayerStore | None
    seen: int
    forwards: int

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def take_layer_inputs(self) -> torch.Tensor | None: ...


@dataclass
class _Pending:
    """A managed layer's scores waiting for a global allocation at the end of the forward."""

    layer: LayerState
    step: LayerStep
    scores: torch.Tensor
    nominal: torch.Tensor
    lengths: torch.Tensor
    sliding_window: int | None


@dataclass
class _Deferred:
    """A prompt's compaction (and sliding-window trim) waiting to learn whether the prompt continues."""

    store: LayerStore
    plan: Plan | None
    trim_below: int | None


class Engine:
    """Runs a :class:`Policy` on the layers of one cache.

    **Prompts end at the first decoding step.** A multi-token forward computes its plan at its end, but
    the plan is applied when the layer is next used by a single-token (decoding) forward, or when the
    cache is inspected or copied (:meth:`flush`). A multi-token forward that finds a plan waiting
    continues the same prompt (``generate(..., prefill_chunk_size=m)`` feeds a prompt in chunks): the
    waiting plan is dropped and the prompt is planned again at the end of the new chunk, so a chunked
    prompt is compressed once, after its last chunk, exactly like the same prompt in one forward (the
    window statistics come from the last chunk; H2O-style accumulators have seen every chunk). The
    ``blockwise`` schedule evicts inside the forward and never defers.
    """

    def __init__(self, policy: Policy, info: ModelInfo):
        self.policy = policy
        self.info = info
        self.managed = info.managed_layers
        self.compactions = 0
        self._global = policy.allocator.scope == "global"
        self._budget_spec = policy.budget_spec
        self._window = self._budget_spec.window
        self._needs = policy.scorer.needs() if policy.scorer is not None else frozenset()
        self._side = policy.side()
        self._mask_memo: tuple[object, torch.Tensor | None] | None = None
        self._valid_memo: tuple[object, int, int, torch.Tensor | None] | None = None
        self._pending: list[_Pending] = []
        self._deferred: dict[int, _Deferred] = {}
        self._fire_forward = False
        self._rows_over: torch.Tensor | None = None
        #: Per managed layer, each batch row's selector configuration (recorded at its first decoding step).
        self._row_configs: dict[int, list[dict[str, int]] | None] = {}
        self._forward_compressed = False
        self._noop_warned = False
        #: The cache's layers (the cache sets this; read only to total a global budget).
        self.layers: list[LayerState] = []

    # ------------------------------------------------------------------ stores
    def init_store(self, store: LayerStore, managed: bool) -> None:
        """Side data and hooks a new store of a managed layer needs."""
        if not managed:
            return
        for spec in self._side:
            store.ensure_side(spec)
        for hook in self.policy.hooks():
            store.add_hook(hook)

    def wants_layer_inputs(self) -> bool:
        return LAYER_INPUTS in self._needs

    def reset(self) -> None:
        self._row_configs = {}
        self._pending = []
        self._deferred = {}
        self._mask_memo = self._valid_memo = None

    # ------------------------------------------------------------------ per-forward memos
    def _padding(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The boolean padding mask (None when every token is real), computed once per forward."""
        memo = self._mask_memo
        if memo is not None and memo[0] is attention_mask:
            return memo[1]
        pad = padding_from_mask(attention_mask)
        self._mask_memo = (attention_mask, pad)
        return pad

    def _token_valid(self, pad: torch.Tensor | None, seen: int, q_len: int) -> torch.Tensor | None:
        """Which of the new tokens are real ``(batch, q)``; None when all are (memoised across layers)."""
        if pad is None:
            return None
        memo = self._valid_memo
        if memo is not None and memo[0] is pad and memo[1] == seen and memo[2] == q_len:
            return memo[3]
        valid = pad[:, seen : seen + q_len]
        result = None if bool(valid.all()) else valid
        self._valid_memo = (pad, seen, q_len, result)
        return result

    # ------------------------------------------------------------------ one layer forward
    def attend(
        self,
        layer: LayerState,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        form: AttentionForm,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Append, attend, observe and maybe compact one layer; returns ``(batch, q, q_heads, d)``."""
        new_keys, new_values = layer.take_pending()
        q_len, seen = query.shape[2], layer.seen
        self._settle(layer.layer_idx, continuation=q_len > 1)
        if attention_mask is not None and attention_mask.shape[-1] < seen + q_len:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} tokens but the cache has seen {seen} and this "
                f"call adds {q_len}; pass the mask of all tokens so far (shape (batch, {seen + q_len}))"
            )
        pad = self._padding(attention_mask)
        inputs = layer.take_layer_inputs()
        block = self.policy.block_size if not layer.left_alone else None
        block = block or q_len
        if block >= q_len:
            return self._chunk(layer, module, query, new_keys, new_values, pad, form, sliding_window, inputs)
        outputs = []
        for lo in range(0, q_len, block):
            hi = min(lo + block, q_len)
            chunk_pad = None if pad is None else pad[:, : seen + hi]
            chunk_inputs = None if inputs is None else inputs[:, lo:hi]
            outputs.append(self._chunk(
                layer, module, query[:, :, lo:hi], new_keys[:, :, lo:hi], new_values[:, :, lo:hi],
                chunk_pad, form, sliding_window, chunk_inputs,
            ))
        return torch.cat(outputs, dim=1)

    def observe_only(
        self,
        layer: LayerState,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        form: AttentionForm,
        sliding_window: int | None,
        memo: dict[object, torch.Tensor] | None = None,
    ) -> None:
        """A shared prefill's follower: store, observe and compact a prompt whose output another cache computed.

        Only valid for a layer's first forward of more than one token on an empty store under a
        non-blockwise schedule: its output would then be plain causal attention over the prompt itself,
        the same for every cache (:func:`kvsieve.engine.shared_prefill.prefill_shared` checks this).
        Before their compaction all followers hold exactly the prompt's entries, so they share one
        ``memo`` of statistics.
        """
        new_keys, new_values = layer.take_pending()
        assert layer.seen == 0 and query.shape[2] > 1, "observe_only: not a first prompt forward"
        self._settle(layer.layer_idx, continuation=True)
        pad = padding_from_mask(attention_mask)
        step = self._append(layer, module, query, new_keys, new_values, pad, form, sliding_window,
                            layer.take_layer_inputs())
        if memo is not None:
            step._memo = memo
        self._after_output(layer, step, sliding_window)

    def _chunk(
        self,
        layer: LayerState,
        module: torch.nn.Module,
        query: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        pad: torch.Tensor | None,
        form: AttentionForm,
        sliding_window: int | None,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """One forward (or one block of it) of one layer: ``pad`` covers every slot up to this chunk's end."""
        store = layer.store
        assert store is not None
        first = layer.seen == 0 and store.total_entries() == 0
        step = self._append(layer, module, query, new_keys, new_values, pad, form, sliding_window, inputs)
        if first:
            mask = dense_causal_mask(step.q_len, step.q_len, pad, sliding_window, query.device)
            if form.explicit:  # soft-capping or sinks: SDPA cannot, so as the model's eager attention
                if mask is None and step.q_len > 1:
                    mask = causal_mask(step.q_len, query.device)
                output = attend(module, query, new_keys, new_values, mask, form)
            else:
                output = sdpa_attention(module, query, new_keys, new_values, mask, form.scaling)
        else:
            output = self._attend_held(layer, step, module, sliding_window)
        self._after_output(layer, step, sliding_window)
        return output

    def _attend_held(
        self, layer: LayerState, step: LayerStep, module: torch.nn.Module, sliding_window: int | None
    ) -> torch.Tensor:
        view = step.view
        bias = step.bias()
        expanded = None if layer.left_alone else self.policy.action.expanded(step)
        if expanded is not None:  # EMS w. pos: centres expanded to the positions they stand for
            keys, values, positions, valid, bias = expanded
            mask = output_mask(lambda: step.query_positions, lambda: positions, valid, sliding_window, step.groups,
                               bias, step.query.dtype, newest_query=step.is_decoding)
            return attend(module, step.query, keys, values, mask, step.form)
        selector = self.policy.selector
        if selector is not None and step.is_decoding and not layer.left_alone:
            subset = select_by_row(selector, step, self._row_configs)
            if subset is not None:
                blend = None
                if isinstance(subset, Selection):  # SparQ: the subset's output mixed with a fallback
                    subset, blend = subset.indices, (subset.weight, subset.fallback)
                output = attend(module, step.query, view.keys, view.values, None, step.form,
                                subset=subset, bias=bias, key_valid=view.valid, blend=blend)
                # "t ≥ N → exact attention" per row: a row holding no more than the selector's token budget
                # attends to everything, as it would alone, whatever its neighbours hold
                exact = step.store.lengths().amax(dim=1) <= getattr(selector, "k", 0)  # host: no device sync
                if bool(exact.any()):
                    full = self._attend_all(step, module, sliding_window, bias)
                    output = torch.where(exact.to(output.device)[:, None, None, None], full, output)
                return output
        return self._attend_all(step, module, sliding_window, bias)

    def _attend_all(
        self, step: LayerStep, module: torch.nn.Module, sliding_window: int | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of the step's queries over every held entry (visibility from stored positions)."""
        view = step.view
        if step.is_decoding and view.valid is None and sliding_window is None and bias is None:
            return attend(module, step.query, view.keys, view.values, None, step.form)
        mask = output_mask(
            lambda: step.query_positions, lambda: view.positions, view.valid, sliding_window, step.groups, bias,
            step.query.dtype, newest_query=step.is_decoding,
        )
        return attend(module, step.query, view.keys, view.values, mask, step.form)

    def _append(
        self,
        layer: LayerState,
        module: torch.nn.Module,
        query: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        pad: torch.Tensor | None,
        form: AttentionForm,
        sliding_window: int | None,
        inputs: torch.Tensor | None,
    ) -> LayerStep:
        """Append this chunk's (non-padding) entries and describe the forward as a :class:`LayerStep`."""
        q_len, seen = query.shape[2], layer.seen
        token_valid = self._token_valid(pad, seen, q_len)
        store = layer.store
        assert store is not None
        if self.policy.expand_gqa:
            groups = query.shape[1] // new_keys.shape[1]
            new_keys = new_keys.repeat_interleave(groups, dim=1)
            new_values = new_values.repeat_interleave(groups, dim=1)
        store.append(new_keys, new_values, seen, token_valid)
        layer.seen = seen + q_len
        step = LayerStep(
            module=module, layer_idx=layer.layer_idx, info=self.info, query=query, first_position=seen,
            query_valid=token_valid, store=store, scaling=form.scaling, form=form, sliding_window=sliding_window,
            forward_index=layer.forwards, layer_inputs=inputs,
            allowed=None if layer.left_alone else self._needs, padding=pad,
        )
        layer.forwards += 1
        return step

    # ------------------------------------------------------------------ observe → plan → act
    def _after_output(self, layer: LayerState, step: LayerStep, sliding_window: int | None) -> None:
        """Observation and compaction (managed layers), then the sliding-window trim."""
        scorer = self.policy.scorer
        deferred = False
        if not layer.left_alone and scorer is not None:
            updates = scorer.observe(step)
            for name, values in updates.items():
                step.store.add_dense(name, values)
            if self._global:
                deferred = self._collect_global(layer, step, sliding_window)
            else:
                plan = self._plan(layer, step) if self._fires(layer, step) else None
                if self._defers(step):
                    trim = None if sliding_window is None else layer.seen - sliding_window + 1
                    self._deferred[layer.layer_idx] = _Deferred(step.store, plan, trim)
                    deferred = True
                elif plan is not None:
                    self._act(step.store, plan)
                self._note_forward(layer, step, plan is not None)
        if sliding_window is not None and not deferred:
            # The next query (position ``seen``) sees keys at positions > seen - window: drop older ones.
            step.store.keep_positions_after(layer.seen - sliding_window + 1)

    def _defers(self, step: LayerStep) -> bool:
        """A prompt forward's plan waits for the prompt to end (not under ``blockwise``)."""
        return not step.is_decoding and self.policy.schedule.block_length() is None

    def _act(self, store: LayerStore, plan: Plan) -> None:
        self.policy.action.apply(store, plan)
        self.compactions += 1

    def _settle(self, layer_idx: int, continuation: bool) -> None:
        """Apply (the prompt ended) or drop (it continues) a layer's waiting plan; trims always apply."""
        entry = self._deferred.pop(layer_idx, None)
        if entry is None:
            return
        if entry.plan is not None and not continuation:
            self._act(entry.store, entry.plan)
        if entry.trim_below is not None:
            entry.store.keep_positions_after(entry.trim_below)

    def flush(self) -> None:
        """Apply every waiting prompt compaction now (before inspecting, copying or reordering the cache)."""
        for layer_idx in list(self._deferred):
            self._settle(layer_idx, continuation=False)

    def _layer_budget(self, layer_idx: int) -> int | None:
        budget = self.policy.budget
        if budget is None:
            return None
        return self.policy.allocator.layer_budget(budget, layer_idx, self.info.num_layers, self._window)

    def _fires(self, layer: LayerState, step: LayerStep) -> bool:
        return self.policy.schedule.fires(step.is_decoding, step.store.max_length, self._layer_budget(layer.layer_idx))

    def _nominal(self, layer: LayerState, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = step.lengths()
        nominal = self.policy.allocator.nominal(
            self._budget_spec, lengths.cpu(), layer.layer_idx, self.info.num_layers, self._window
        ).to(lengths.device)
        return lengths, nominal

    def _plan(self, layer: LayerState, step: LayerStep) -> Plan | None:
        """Score, allocate and plan one layer; None when every entry is kept."""
        scorer = self.policy.scorer
        assert scorer is not None
        lengths, nominal = self._nominal(layer, step)
        scores = scorer.score(step, nominal)
        counts = self.policy.allocator.allocate(scores, nominal, lengths)
        limit = self.policy.schedule.row_limit(step.is_decoding, self._layer_budget(layer.layer_idx))
        if limit is not None:  # a row compacts only when it is over its own limit, whatever its neighbours hold
            counts = torch.where((lengths.amax(dim=1) > limit)[:, None], counts, lengths)
        if bool((counts >= lengths).all()):
            return None
        return self.policy.action.plan(scores, counts, step)

    def _collect_global(self, layer: LayerState, step: LayerStep, sliding_window: int | None) -> bool:
        """Global allocation: score this layer now, decide for all layers after the last managed one."""
        if layer.layer_idx == self.managed[0]:
            self._pending = []
            self._rows_over = self._rows_over_total(step)
            self._fire_forward = self._rows_over is None or bool(self._rows_over.any())
        deferred = False
        if self._fire_forward:
            scorer = self.policy.scorer
            assert scorer is not None
            lengths, nominal = self._nominal(layer, step)
            scores = scorer.score(step, nominal)
            step.query = step.query[:, :, -1:]  # hold nothing big until the end of the forward
            step._memo = {"lengths": lengths}
            self._pending.append(_Pending(layer, step, scores, nominal, lengths, sliding_window))
            deferred = True
        if layer.layer_idx == self.managed[-1] and self._pending:
            self._act_global()
        return deferred

    def _rows_over_total(self, step: LayerStep) -> torch.Tensor | None:
        """Rows (host bool ``(batch,)``) whose total is over the global budget (plus slack) at a decoding
        step; None: every row (a prompt forward, when the schedule compacts prompts). Each row is its own
        request: a row under its own limit keeps everything, whatever the other rows hold."""
        if not step.is_decoding:
            fires = self.policy.schedule.fires_total(False, 0, None, 0)
            return None if fires else torch.zeros(step.store.batch, dtype=torch.bool)
        budget = self.policy.budget
        total_budget = None if budget is None else sum(self._layer_budget(i) or 0 for i in self.managed)
        heads = step.store.heads
        # held by this (already appended) layer, plus what the other managed layers will hold after their append
        total = step.store.lengths().sum(dim=1) + step.q_len * heads * (len(self.managed) - 1)
        for other in (self.layers[i].store for i in self.managed):
            if other is not None and other is not step.store:
                total = total + other.lengths().sum(dim=1)
        # the slack (``buffer`` per head) counts every head of every managed layer, as the budget does
        managed_heads = heads * len(self.managed)
        limit = (total_budget or 0) * heads
        fires = self.policy.schedule.fires_total
        return torch.tensor([fires(True, int(t), limit, managed_heads) for t in total.tolist()])

    def _act_global(self) -> None:
        pending, self._pending = self._pending, []
        counts = self.policy.allocator.allocate_global(
            [p.scores for p in pending], [p.nominal for p in pending], [p.lengths for p in pending]
        )
        compressed = False
        for item, count in zip(pending, counts, strict=True):
            if self._rows_over is not None:  # rows under their own limit keep everything
                count = torch.where(self._rows_over.to(count.device)[:, None], count, item.lengths.to(count.device))
            plan = None
            if not bool((count >= item.lengths).all()):
                plan = self.policy.action.plan(item.scores, count, item.step)
                compressed = True
            trim = None if item.sliding_window is None else item.layer.seen - item.sliding_window + 1
            if self._defers(item.step):
                self._deferred[item.layer.layer_idx] = _Deferred(item.step.store, plan, trim)
                continue
            if plan is not None:
                self._act(item.step.store, plan)
            if trim is not None:
                item.step.store.keep_positions_after(trim)
        if pending and not pending[-1].step.is_decoding:
            self._warn_if_noop(compressed, pending[-1].layer.seen)

    def _note_forward(self, layer: LayerState, step: LayerStep, compressed: bool) -> None:
        """Warn once when a whole prompt forward compressed nothing (budget ≥ prompt length)."""
        if step.is_decoding or not self.managed or self.policy.schedule.name != "prefill":
            return
        if layer.layer_idx == self.managed[0]:
            self._forward_compressed = False
        self._forward_compressed |= compressed
        if layer.layer_idx == self.managed[-1]:
            self._warn_if_noop(self._forward_compressed, layer.seen)

    def _warn_if_noop(self, compressed: bool, seen: int) -> None:
        if compressed or self._noop_warned or self.policy.schedule.name != "prefill":
            return
        self._noop_warned = True
        warnings.warn(
            f"kvsieve: {self.policy}: nothing was compressed in this prompt forward (the budget covers all "
            f"{seen} tokens seen so far); later forwards compress once the cache outgrows the budget",
            stacklevel=4,
        )
