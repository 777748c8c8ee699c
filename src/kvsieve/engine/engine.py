"""The engine: one owner of append → attend → observe → plan → act for a cache.

Per layer and forward call (from the registered attention function), with the call's arguments resolved
once into a :class:`~kvsieve.engine.layer_call.LayerCall`:

1. **append** the new, non-padding entries to the layer's store (absolute positions);
2. **attend** with the one kernel (:mod:`kvsieve.engine.attention_output`): plain SDPA on a layer's first
   prompt (bit-exact with transformers), otherwise over the held entries with visibility from stored
   positions, the merge-count bias, and — at decoding — the selector's subset;
3. **observe**: the scorer's side-data updates (H2O's accumulated attention);
4. **plan** when the schedule fires (:mod:`kvsieve.engine.layer_plans`): nominal budgets → scores →
   counts → the action's plan. A layer-scope allocator plans right away; a global one
   (:mod:`kvsieve.engine.global_plans`) gets every managed layer's scores and plans once after the last
   managed layer of the forward (nothing is held longer than the forward);
5. **act**: the action executes the plan on the store — at once, or, for a prompt forward, when the
   prompt ends (:mod:`kvsieve.engine.deferral`).

Under the ``blockwise`` schedule a long forward is processed in blocks of ``block_size`` queries per
layer, each block going through steps 1–5; block ``i`` of layer ``l`` depends only on layer ``l``'s
cache after block ``i - 1`` and on layer ``l - 1``'s output for block ``i``, so this is the same
computation as feeding the model one block at a time.

The engine never imports the cache module: layers are duck-typed (:class:`LayerState`).
"""

from __future__ import annotations

import sys

import torch

from kvsieve.attention.kernel import AttentionForm
from kvsieve.attention.masks import padding_from_mask
from kvsieve.cache.store import LayerStore
from kvsieve.core.step import (
    COLUMN_MAXIMA,
    COLUMN_SUMS,
    LAYER_INPUTS,
    MERGE_COUNT,
    WINDOW_ROWS,
    AppendedUpdate,
    DeferredUpdate,
    LayerStep,
)
from kvsieve.engine import attention_output
from kvsieve.engine.attention_output import first_prompt_output, held_output
from kvsieve.engine.deferral import Deferral
from kvsieve.engine.global_plans import GlobalPlans
from kvsieve.engine.layer_call import LayerCall, LayerState
from kvsieve.engine.layer_plans import LayerPlans
from kvsieve.engine.merge_in_place import MergeInPlace, decoding_counts
from kvsieve.engine.noop_warning import NoopWarning
from kvsieve.engine.probe import Probe
from kvsieve.models.architectures import ModelInfo
from kvsieve.native import decoding_rows, evict_lowest, merge_lowest
from kvsieve.parts.actions.base import Action
from kvsieve.parts.scorers.base import Scorer
from kvsieve.policies.policy import Policy
from kvsieve.transformers_adapter import sdpa_attention

__all__ = ["Engine", "LayerState"]


def check_mask_covers(padding: torch.Tensor | None, seen: int, q_len: int) -> None:
    """Refuse a padding mask that does not cover every token so far (the cache has seen ``seen``, the call adds
    ``q_len``)."""
    if padding is not None and padding.shape[-1] < seen + q_len:
        raise ValueError(
            f"attention_mask covers {padding.shape[-1]} tokens but the cache has seen {seen} and this "
            f"call adds {q_len}; pass the mask of all tokens so far (shape (batch, {seen + q_len}))"
        )


class Engine:
    """Runs a :class:`Policy` on the layers of one cache: the per-layer step, with its helpers for prompt
    deferral (:class:`Deferral`), layer plans (:class:`LayerPlans`) and global plans (:class:`GlobalPlans`).

    A prompt forward's plan waits until the prompt ends (its first decoding step) or the cache is inspected
    (:meth:`flush`); see :mod:`kvsieve.engine.deferral`.
    """

    def __init__(self, policy: Policy, info: ModelInfo):
        self.policy = policy
        self.info = info
        self.managed = info.managed_layers
        self._global = policy.allocator.scope == "global"
        self._needs = (policy.scorer.needs() if policy.scorer is not None else frozenset()) | policy.allocator.needs()
        #: The action attends over the held entries as stored (EMS with positions expands merged centres).
        self._plain_action = type(policy.action).expanded is Action.expanded
        self._every_row = torch.ones(0, dtype=torch.bool)  # (batch,) all True: every row fuses its decoding output
        #: Nothing to observe, plan or select at a decoding step (``full``): :meth:`_plain_decoding_step`.
        self._observes_nothing = policy.scorer is None and policy.selector is None and not policy.expand_gqa
        #: ... or whose scorer observes nothing and whose schedule never compacts at a decoding step (every
        #: prefill-schedule policy: snapkv, pyramidkv, restkv, ...): a decoding step only appends and attends.
        #: KVzip's scorer observes probe forwards only: once its probe ran, it decodes plainly too, its per-entry
        #: score (side data no decoding step reads) appended at its fill.
        scorer = policy.scorer
        observes_probes_only = scorer is not None and scorer.OBSERVES_PROBES_ONLY
        self._decodes_plainly = self._observes_nothing or (
            policy.selector is None and not policy.expand_gqa and scorer is not None
            and (type(scorer).observe is Scorer.observe or observes_probes_only)
            and not policy.schedule.fires(True, sys.maxsize, 0)
            and not policy.schedule.fires_total(True, sys.maxsize, 0, 1)
        )
        #: ... or whose scorer only defers side data computed from a decoding step's layer inputs (the retention
        #: gates, :meth:`Scorer.decoding_updates`) under an evicting action: a decoding step that plans nothing
        #: appends, defers and attends (:meth:`_plain_decoding_step`); one that plans takes the general step.
        #: No selector, GQA expansion, expanded centres or hooks, and no side data but the scorer's: a decoding step
        #: may skip describing itself (:meth:`_plain_decoding_step`, :meth:`_evicting_step`).
        plain_shape = (scorer is not None and policy.selector is None and not policy.expand_gqa and self._plain_action
                       and not policy.hooks())
        policy_sides = {spec.name for spec in policy.side()}
        scorer_sides = {spec.name for spec in scorer.side()} if scorer is not None else set()
        plain_parts = plain_shape and policy_sides == scorer_sides
        self._defers_plainly = (
            not self._decodes_plainly and plain_parts and scorer is not None
            and type(scorer).decoding_updates is not Scorer.decoding_updates and not policy.action.quantizes
        )
        #: Side data a plain decoding step may leave to the store's append (no decoding step reads or updates it), or
        #: hand to the store deferred (:attr:`_defers_plainly`).
        self._passive_side = frozenset(spec.name for spec in scorer.side()) \
            if observes_probes_only or self._defers_plainly else frozenset()
        self._side = policy.side()
        self._mask_memo: tuple[object, torch.Tensor | None] | None = None
        self._valid_memo: tuple[object, int, int, torch.Tensor | None] | None = None
        self._plans = LayerPlans(policy, info)
        #: An every-step decoding eviction that observes, plans and drops in one pass (:meth:`_evicting_step`): the
        #: side data it accumulates (H2O's) or "" (scores from the query's row alone: TOVA's); None where none does.
        in_place = self._plans.accumulator() or ("" if self._plans.scores_from_row() else None)
        self._in_place = in_place if (
            plain_parts and not self._global and type(policy.action).apply is Action.apply
        ) else None
        #: ... or EMS's evict-then-merge at every decoding step (:mod:`kvsieve.engine.merge_in_place`): the same
        #: parts but for the action's merge counts.
        self._merge = MergeInPlace(policy) if (
            plain_shape and policy_sides == scorer_sides | {MERGE_COUNT} and MergeInPlace.applies(policy)
            and self._plans.uniform_budget and not self._global
        ) else None
        self._deferral = Deferral(policy)
        self._warning = NoopWarning(policy, self.managed)
        self._global_plans = GlobalPlans(policy, self.managed, self._plans, self._deferral, self._warning)
        #: Per managed layer, each batch row's selector configuration (recorded at its first decoding step).
        self._row_configs: dict[int, list[dict[str, int]] | None] = {}
        #: The cache's layers (the cache sets this; read only to total a global budget).
        self.layers: list[LayerState] = []
        #: Set while a probe forward runs (:func:`kvsieve.engine.probe.probing`).
        self.probe: Probe | None = None
        #: The scorer reads a probe (KVzip): it plans only on the final probe forward.
        self._reconstructs = bool(getattr(policy.scorer, "RECONSTRUCTS", False))
        #: A final probe planned this cache (its reconstruction ran).
        self.reconstructed = False

    @property
    def compactions(self) -> int:
        """Compactions executed so far (one per layer and firing; a saved context restores it)."""
        return self._deferral.compactions

    @compactions.setter
    def compactions(self, value: int) -> None:
        self._deferral.compactions = value

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
        self._global_plans.clear()
        self._deferral.clear()
        self._mask_memo = self._valid_memo = None
        self.reconstructed = False

    def flush(self) -> None:
        """Apply every waiting prompt compaction now (before inspecting, copying or reordering the cache)."""
        self._deferral.flush()

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
        """Append, attend, observe and maybe compact one layer; returns ``(batch, q, q_heads, d)``.

        The arguments are the attention function's; they become one :class:`LayerCall` here. A decoding call that
        SDPA's form serves is :meth:`attend_decoding`'s (the attention function calls it directly).
        """
        q_len = query.shape[2]
        if form.serves_decoding(q_len, sliding_window):
            return self.attend_decoding(layer, module, query, attention_mask, form)
        new_keys, new_values = layer.take_pending()
        self._deferral.settle(layer.layer_idx, continuation=q_len > 1)
        check_mask_covers(attention_mask, layer.seen, q_len)
        return self._general_step(layer, module, query, new_keys, new_values, attention_mask, form, sliding_window)

    def attend_decoding(
        self,
        layer: LayerState,
        module: torch.nn.Module,
        query: torch.Tensor,
        padding: torch.Tensor | None,
        form: AttentionForm,
    ) -> torch.Tensor:
        """:meth:`attend` for a decoding call that SDPA's form serves (one query, no sliding window, no soft-capping
        or sinks), which the attention function routes here directly (issue 22: the general call's layers of
        checks cost ~1% of a small model's decoding step): every-step eviction in one pass
        (:meth:`_evicting_step`), a plain step (:meth:`_plain_decoding_step`), else the general step."""
        new_keys, new_values = layer.take_pending()
        self._deferral.settle(layer.layer_idx, continuation=False)
        if padding is not None:
            check_mask_covers(padding, layer.seen, 1)
        if self._in_place is not None or self._merge is not None:
            output = self._evicting_step(layer, module, query, new_keys, new_values, padding, form)
            if output is not None:
                return output
        if self._decodes_plainly or self._defers_plainly:
            output = self._plain_decoding_step(layer, module, query, new_keys, new_values, padding, form)
            if output is not None:
                return output
        return self._general_step(layer, module, query, new_keys, new_values, padding, form, None)

    def _general_step(
        self, layer: LayerState, module: torch.nn.Module, query: torch.Tensor, new_keys: torch.Tensor,
        new_values: torch.Tensor, attention_mask: torch.Tensor | None, form: AttentionForm, sliding_window: int | None,
    ) -> torch.Tensor:
        """Describe the call and run :meth:`_step` on it (in blocks where the policy prefills block-wise)."""
        q_len, seen = query.shape[2], layer.seen
        call = LayerCall(
            layer, module, query, new_keys, new_values, self._padding(attention_mask), form, sliding_window,
            layer.take_layer_inputs(),
        )
        block = self.policy.block_size if not layer.left_alone else None
        block = block or q_len
        if block >= q_len:
            return self._step(call)
        return torch.cat([self._step(part) for part in call.blocks(block, seen)], dim=1)

    def _plain_decoding_step(
        self, layer: LayerState, module: torch.nn.Module, query: torch.Tensor, new_keys: torch.Tensor,
        new_values: torch.Tensor, attention_mask: torch.Tensor | None, form: AttentionForm,
    ) -> torch.Tensor | None:
        """A decoding step of a policy that neither observes nor compacts while decoding (``full``, and every
        prefill-schedule policy whose scorer observes nothing: ``snapkv``, ``pyramidkv``, ``restkv``..., and
        ``kvzip`` once its probe ran): append
        in place and attend over the held entries — what :meth:`_step` does for it (nothing to observe, no plan,
        no selector; transformers' SDPA call, or the packed call once the cache has compacted something, as
        :func:`~kvsieve.engine.attention_output.packs_decoding_query` decides), without describing the step first.
        Ragged heads (AdaKV) attend as the general step does: strided runs and length groups in place, a padded
        layout over its buffers with its additive mask, a compact one through one dense view; quantized tiers
        (``mixed``, any prefill-schedule policy with a quantizing action) through the tiers' attention view. None
        (the general step runs instead) unless the store holds entries and keeps no hooks or side data but a probe-only
        scorer's (KVzip's score: the append gives the new entry its fill, as the general step's does), and the new
        token is real in every row; for KVzip, unless its probe ran (the general step warns). A scorer that only
        defers side data at decoding (the retention gates of ``trimkv``/``dbtrimkv``: :attr:`_defers_plainly`) takes
        it at every step that plans nothing: the new entry's side data is handed to the store deferred, as the
        general step's observation hands it; a step whose schedule fires (a layer over its budget plus buffer, or
        for a global budget a row over its total) takes the general step. Equality with the general step is tested
        bit for bit."""
        store = layer.store
        assert store is not None
        seen = layer.seen
        if self.probe is not None or seen == 0 or store.hooks \
                or (store.holds_side and not self._passive_side.issuperset(store.side_names())) \
                or (attention_mask is not None
                    and self._token_valid(self._padding(attention_mask), seen, 1) is not None):
            return None
        if self._reconstructs and not self.reconstructed and self._deferral.compactions == 0:
            return None  # the general step warns that the probe has not run
        defers = self._defers_plainly and not layer.left_alone
        if defers and self._plans_this_step(layer, store, seen):
            return None  # this forward plans the layer: the general step scores it
        inputs = layer.take_layer_inputs()
        if defers and inputs is None:  # refused before the append, as the general step's observation would refuse
            raise RuntimeError("layer inputs were not captured for this forward (see kvsieve.engine.layer_inputs)")
        store.append(new_keys, new_values, seen, None)
        layer.seen = seen + 1
        layer.forwards += 1
        if defers and inputs is not None:  # the new entry's side data, computed with later steps' (input kept)
            assert self.policy.scorer is not None
            for name, update in (self.policy.scorer.decoding_updates(layer.layer_idx, store.heads, inputs)
                                 or {}).items():
                store.defer_to_appended(name, update.inputs, update.compute)
        if store.tiered:  # quantized entries: every held entry in the tiers' unordered view, as the general step
            return attention_output.tiered_decoding_output(module, store, query, form.scaling,
                                                           self._deferral.compactions > 0, form.explicit)
        if not store.is_uniform:  # ragged heads: read in place where the layout allows, else one dense view
            output = attention_output.ragged_decoding_output(store, query, form.scaling)
            if output is None:
                view = store.dense()
                output = attention_output.packed_decoding_output(query, view.keys, view.values, form.scaling,
                                                                 view.valid)
                store.release_views()  # the gathered view lives for this step only, as after the general step
            return output
        keys, values = store.held_views()
        if self._deferral.compactions > 0 and attention_output.packs_query(query, form, keys.shape[1]):
            return attention_output.packed_decoding_output(query, keys, values, form.scaling)
        return sdpa_attention(module, query, keys, values, None, form.scaling)

    def _evicting_step(
        self, layer: LayerState, module: torch.nn.Module, query: torch.Tensor, new_keys: torch.Tensor,
        new_values: torch.Tensor, attention_mask: torch.Tensor | None, form: AttentionForm,
    ) -> torch.Tensor | None:
        """A decoding step of every-step eviction that drops one entry per head by an accumulated score or the
        query's row alone (``h2o``, ``tova`` with ``schedule="decode"``), or merges or evicts it (``ems``), on the
        CPU: append in place, the output and the float32 rows from one pass (:mod:`kvsieve.native.decoding_rows`, as
        :meth:`LayerStep.decoding_output_from_row`, with EMS's ``log(count)`` bias), then the observation, the plan
        and the drop in one more, in place (:meth:`_drop_lowest`) — what :meth:`_step` computes for it, bit for bit
        for h2o and tova (EMS: within float32 rounding, the same decisions; :mod:`kvsieve.engine.merge_in_place`;
        tested), without describing the step or building the plan (issue 22: about twenty small PyTorch operations
        per layer were a fifth of the step, ~300 for EMS).
        None (the general step runs, nothing changed) unless the uniform store holds exactly its budget, keeps no
        hooks and the new token is real in every row; where a pass declines after the append (a tie among the lowest
        scores, TOVA's heads not aligned), the general step's remainder finishes the step from where it stands."""
        store = layer.store
        assert store is not None
        seen = layer.seen
        if layer.left_alone or self.probe is not None or seen == 0 or store.hooks or not store.is_uniform \
                or query.device.type != "cpu" \
                or not (merge_lowest.available() if self._merge is not None else evict_lowest.available()) \
                or self._token_valid(self._padding(attention_mask), seen, 1) is not None:
            return None
        candidates = self._plans.lowest_candidates(layer.layer_idx, store.max_length + 1)
        if candidates is None:
            return None
        store.append(new_keys, new_values, seen, None)
        layer.seen = seen + 1
        keys, values = store.held_views()
        counts = decoding_counts(store) if self._merge is not None else None
        fused = decoding_rows.attend(query, form.scaling, keys, values, None, counts, counts=True)
        dropped = None if fused is None else self._drop_lowest(store, fused[1], candidates, module, layer.layer_idx,
                                                               seen)
        if dropped:
            assert fused is not None
            layer.take_layer_inputs()  # none is read: dropped, as the general step's call would drop it
            layer.forwards += 1
            self._deferral.compactions += 1
            return fused[0]
        call = LayerCall(layer, module, query, new_keys, new_values, None, form, None, layer.take_layer_inputs())
        step = self._describe(call, seen, None)
        if fused is None:  # the general step from its output on
            output = step.decoding_output_from_row()
            self._after_output(call, step)
        else:
            output, step._memo[("rows", 1)] = fused
            if dropped is None:  # nothing changed: observe, plan and act
                self._after_output(call, step)
            else:  # a tie: observed (H2O's sums), nothing moved; the general plan decides
                self._plan(call, step)
        store.release_views()
        return output

    def _drop_lowest(self, store: LayerStore, rows: torch.Tensor, candidates: int, module: torch.nn.Module,
                     layer_idx: int, newest: int) -> bool | None:
        """:meth:`_evicting_step`'s pass over the step's softmax ``rows``: H2O's accumulated sums, the scores the
        scorer takes from the rows alone (TOVA's), or EMS's evict-then-merge (the new entry at position ``newest``);
        returns as :meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_lowest` does."""
        reserve = self.policy.schedule.decoding_reserve()
        if self._merge is not None:
            budget = self._plans.layer_budget(layer_idx)
            assert budget is not None
            return self._merge.drop(store, rows, candidates, reserve, budget, module.config, layer_idx, newest)
        if self._in_place:
            return store.drop_lowest(rows, self._in_place, candidates, reserve)
        assert self.policy.scorer is not None
        scores = self.policy.scorer.scores_from_row(rows, store.heads)
        return None if scores is None else store.drop_lowest_scored(scores, candidates, reserve)

    def _plans_this_step(self, layer: LayerState, store: LayerStore, seen: int) -> bool:
        """Before a decoding step's append: whether this forward plans this managed layer (its schedule fires once
        the step's entry is appended; a global budget decides for the whole forward at its first managed layer)."""
        if self._global:
            return self._global_plans.fires_at_decoding(layer.layer_idx, store, seen, self.layers)
        return self._plans.fires_decoding(layer.layer_idx, store.max_length + 1)

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
        self._deferral.settle(layer.layer_idx, continuation=True)
        call = LayerCall(
            layer, module, query, new_keys, new_values, padding_from_mask(attention_mask), form, sliding_window,
            layer.take_layer_inputs(),
        )
        step = self._append(call)
        if memo is not None:
            step._memo = memo
        if "colsum" not in step._memo:  # the sums of this cache's own prefill: the flash route's where it applies
            self._flash_statistics(call, step)
        self._after_output(call, step)
        step.store.release_views()

    def _step(self, call: LayerCall) -> torch.Tensor:
        """One forward (or one block of it) of one layer: append → attend → observe → plan → act."""
        layer = call.layer
        store = layer.store
        assert store is not None
        first = layer.seen == 0 and store.total_entries() == 0
        step = self._append(call)
        if self._fuses_statistics(call, step):
            output = step.output_with_column_sums()
        elif first and (flash := self._flash_statistics(call, step)) is not None:
            output = flash
        elif (fused_rows := self._fused_decoding_rows(call, step)) is not None:
            output = step.decoding_output_from_row()
            # rows that do not compact now keep SDPA, as they would alone (every row fuses: nothing to check)
            if fused_rows is not self._every_row and not bool(fused_rows.all()):
                plain = held_output(self.policy, self._row_configs, call, step, self._deferral.compactions > 0)
                output = torch.where(fused_rows.to(output.device)[:, None, None, None], output, plain)
        elif self._fuses_probe_maxima(call, step):
            output = step.output_with_column_maxima()
        elif first:
            output = first_prompt_output(call, step)
        else:
            output = held_output(self.policy, self._row_configs, call, step, self._deferral.compactions > 0)
        self._after_output(call, step)
        store.release_views()  # a gathered or dequantized view held between steps would double the memory
        return output

    def _fuses_statistics(self, call: LayerCall, step: LayerStep) -> bool:
        """Whether this prompt forward's output comes from the pass that also computes the column sums.

        Opt-in (``fuse_statistics=True``): the output then differs from SDPA's — and so the prompt's later
        layers and logits from plain transformers' — by float rounding, where the default keeps them bit for
        bit (except a causal first prompt, whose output is the flash kernel's, SDPA's own:
        :mod:`kvsieve.attention.flash_statistics`; on a CPU with AMX tiles a bf16 causal first prompt — with
        AVX-512 or AVX2 a float32 one — takes :mod:`kvsieve.native.fused_attention` instead, the output within bf16
        (float32) rounding of SDPA's and each exponential taken once). Only for a managed layer whose scorer needs
        column sums, on more than one query, over the held entries as they are (no action that expands merged
        centres), on the CPU, and when this layer can evict now (more entries than its budget, or a ratio): with
        nothing to evict the output stays SDPA's.
        Not on a GPU, where SDPA (FlashAttention) followed by the statistics pass is faster than this float32
        PyTorch pass (H200, h2o prefill at 4k: 0.26 s unfused, 0.29 s fused;
        ``benchmarks/results/statistics_prefill_cuda_*.json``).
        """
        return self.policy.fuse_statistics and self._evicts_on_column_sums(call, step)

    def _flash_statistics(self, call: LayerCall, step: LayerStep) -> torch.Tensor | None:
        """A first prompt's output and column sums from the flash kernel and its log-sum-exp, by default (no
        ``fuse_statistics`` needed): the output is SDPA's own on the CPU, bit for bit, so the prompt's logits are
        those of the unfused prefill (tested on every architecture) and only the sums' rounding differs (the
        kernel's fast exponential, ~1e-5 relative; :mod:`kvsieve.attention.flash_statistics`). For every managed
        layer whose scorer needs column sums, whatever its budget and action: the route depends only on the prompt,
        so a shared prefill's followers take the same sums as their own prefills (:meth:`observe_only`). bfloat16,
        float16 and (since session 31) float32 prompts. None where it does not apply (padding, a sliding window,
        soft-capping or sinks, a GPU...): the prompt takes SDPA, and the sums their own pass."""
        if COLUMN_SUMS not in self._needs or call.layer.left_alone or step.q_len == 1 \
                or step.query.device.type != "cpu":
            return None
        return step.flash_output_with_column_sums()

    def _evicts_on_column_sums(self, call: LayerCall, step: LayerStep) -> bool:
        """A managed layer whose scorer needs column sums, on more than one query, over the held entries as they are,
        on the CPU, and able to evict now (more entries than its budget, or a ratio)."""
        if COLUMN_SUMS not in self._needs or call.layer.left_alone:
            return False
        if step.q_len == 1 or not self._plain_action or step.query.device.type != "cpu":
            return False
        budget = self._plans.layer_budget(call.layer.layer_idx)
        if budget is None:
            return bool(self.policy.ratio)
        return step.store.max_length > budget

    def _fused_decoding_rows(self, call: LayerCall, step: LayerStep) -> torch.Tensor | None:
        """The batch rows (host ``bool`` ``(batch,)``) whose decoding output is ``P·V`` from the float32 attention
        row their scorer reads at this step; None: no row's.

        A row that compacts at this decoding step (``schedule="decode"``, or ``"blockwise"``, once over its
        limit) is scored from the new query's softmax row over its held entries: H2O's and EMS's column sums,
        TOVA's and a window scorer's last row (:meth:`LayerStep.window_rows` of one query). Multiplying it by the
        values gives the step's output, so the step makes no SDPA call beside it (issue 22: the statistic from
        the attention pass). That output differs from SDPA's by float rounding, so only for the rows that
        compact at this step, decided by each row's own length as its compaction is (a row's output never
        depends on its neighbours); a step that compacts nothing — every step under the default prefill
        schedule — keeps SDPA, and decoding equals plain transformers on the kept entries bit for bit. For a
        managed layer under a layer-scope allocator, over the held entries as they are (no expanded centres, no
        quantized tiers, no decoding selector). On any device: the row is computed anyway and ``P·V`` is one
        small product.
        """
        if step.q_len != 1 or call.layer.left_alone or self._global or not self._plain_action:
            return None
        if self.policy.selector is not None or step.store.tiered or not self._needs & {COLUMN_SUMS, WINDOW_ROWS}:
            return None
        layer_idx = call.layer.layer_idx
        if not self._plans.fires(layer_idx, step):
            return None
        limit = self.policy.schedule.row_limit(True, self._plans.layer_budget(layer_idx))
        if limit is None:
            return None
        store = step.store
        if store.is_uniform:
            return self._all_rows(store.batch) if store.max_length > limit else None
        rows = store.lengths().amax(dim=1) > limit  # host: no device read
        return rows if bool(rows.any()) else None

    def _all_rows(self, batch: int) -> torch.Tensor:
        if self._every_row.shape[0] != batch:
            self._every_row = torch.ones(batch, dtype=torch.bool)
        return self._every_row

    def _fuses_probe_maxima(self, call: LayerCall, step: LayerStep) -> bool:
        """Whether a probe forward's output comes from the pass that also computes the column maxima (KVzip).

        Always on the CPU for a managed layer whose scorer needs the maxima, over the held entries as they are:
        a probe's output only feeds the probe's later layers (its entries are dropped after it), so the float
        rounding by which this pass differs from SDPA never reaches the user's outputs, and the second, masked
        SDPA pass it saves was a third of the reconstruction's time (4k tokens, default model). Not on a GPU,
        where FlashAttention followed by the maxima pass is the faster route.
        """
        if not step.probing or COLUMN_MAXIMA not in self._needs or call.layer.left_alone:
            return False
        return step.q_len > 1 and self._plain_action and step.query.device.type == "cpu"

    def _append(self, call: LayerCall) -> LayerStep:
        """Append the call's (non-padding) entries and describe the forward as a :class:`LayerStep`."""
        layer, query = call.layer, call.query
        q_len, seen = query.shape[2], layer.seen
        token_valid = self._token_valid(call.padding, seen, q_len)
        store = layer.store
        assert store is not None
        new_keys, new_values = call.keys, call.values
        if self.policy.expand_gqa:
            groups = query.shape[1] // new_keys.shape[1]
            new_keys = new_keys.repeat_interleave(groups, dim=1)
            new_values = new_values.repeat_interleave(groups, dim=1)
        store.append(new_keys, new_values, seen, token_valid)
        layer.seen = seen + q_len
        return self._describe(call, seen, token_valid)

    def _describe(self, call: LayerCall, seen: int, token_valid: torch.Tensor | None) -> LayerStep:
        """The forward whose entries were just appended (at ``seen``) as a :class:`LayerStep`."""
        layer, query, store = call.layer, call.query, call.layer.store
        assert store is not None
        step = LayerStep(
            module=call.module, layer_idx=layer.layer_idx, info=self.info, query=query, first_position=seen,
            query_valid=token_valid, store=store, scaling=call.form.scaling, form=call.form,
            sliding_window=call.sliding_window, forward_index=layer.forwards, layer_inputs=call.layer_inputs,
            allowed=None if layer.left_alone else self._needs, padding=call.padding, probing=self.probe is not None,
        )
        layer.forwards += 1
        return step

    def _after_output(self, call: LayerCall, step: LayerStep) -> None:
        """Observation and compaction (managed layers), then the sliding-window trim.

        A probe forward (:attr:`probe`) only observes: its own entries are dropped and, on the final probe,
        the held entries are planned as a prompt's would be. A scorer that reads a probe
        (``Scorer.RECONSTRUCTS``) plans on nothing else: the cache keeps every entry until its probe ran.
        """
        layer, sliding_window = call.layer, call.sliding_window
        scorer = self.policy.scorer
        managed = not layer.left_alone and scorer is not None
        if managed:
            assert scorer is not None
            updates = scorer.observe(step)
            for name, values in updates.items():
                if isinstance(values, DeferredUpdate):  # computed when first read (a decoding step's entries)
                    step.store.defer_to_appended(name, values.inputs, values.compute)
                elif isinstance(values, AppendedUpdate):
                    step.store.add_to_appended(name, values.values)
                else:
                    step.store.add_dense(name, values)
        probe = self.probe
        if probe is not None:
            step.store.keep_positions_before(probe.context_seen)  # the probe's own tokens are not kept
            layer.seen = probe.context_seen
            step._memo.clear()
            if not (managed and probe.final):
                return
            self.reconstructed = True
        elif self._reconstructs:
            if managed and step.is_decoding and not self.reconstructed \
                    and self._deferral.compactions == 0:  # (a restored saved context counts its compactions)
                self._warning.warn_unreconstructed()
            managed = False
        deferred = self._plan(call, step) if managed else False
        if sliding_window is not None and not deferred:
            # The next query (position ``seen``) sees keys at positions > seen - window: drop older ones.
            self._deferral.trim(step.store, layer.seen - sliding_window + 1, step.is_decoding)

    def _plan(self, call: LayerCall, step: LayerStep) -> bool:
        """Plan this managed layer (now, or for all layers after the last one under a global allocator) and
        execute or defer the plan; returns whether the layer's sliding-window trim waits with it."""
        layer, sliding_window = call.layer, call.sliding_window
        if self._global:
            return self._global_plans.collect(call, step, self.layers)
        layer_idx = layer.layer_idx
        plan = self._plans.plan(layer_idx, step) if self._plans.fires(layer_idx, step) else None
        deferred = False
        if self._deferral.defers(step):
            trim = None if sliding_window is None else layer.seen - sliding_window + 1
            self._deferral.wait(layer_idx, step.store, plan, trim)
            deferred = True
        elif plan is not None:
            self._deferral.act(step.store, plan, step.is_decoding)
        self._warning.note_forward(layer_idx, step.is_decoding, plan is not None, layer.seen)
        return deferred
