"""EMS's every-step decoding compaction in one C pass on the CPU (issue 22), for :meth:`Engine._evicting_step
<kvsieve.engine.engine.Engine._evicting_step>`.

``ems`` with ``schedule="decode"`` (EMS, Li et al. 2024, arXiv:2412.08521, Sec. 3.3 and App. A: the compression
continues at every decoding step) observes each query's row into the Global-Local score
(:class:`~kvsieve.parts.scorers.global_local.GlobalLocal`), scores, and gives up one entry per head, merged into its
most redundant class centre or evicted (:class:`~kvsieve.parts.actions.evict_merge.EvictThenMerge`). The general
step spends ~300 small PyTorch operations per layer on it; :meth:`MergeInPlace.drop` hands it to
:meth:`~kvsieve.cache.store_compaction.StoreCompaction.merge_lowest` (``native/merge.c``) when the policy is exactly
those two parts (a subclass may score or merge otherwise) under a uniform per-layer budget. The side data it updates
are the general step's bit for bit, so are the scores (float64 on both sides, rounded once); the merged rows are
within float32 rounding (the pass's sums run in another order than torch's), and its decisions are the general
step's: both decide the merge target on the float64 redundancy (the pass where float32 is too close to tell), and a
tie even there, or between the lowest two scores, goes to the general step (``merge.c``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvsieve.cache.store import LayerStore
from kvsieve.core.step import MERGE_COUNT
from kvsieve.native.merge_lowest import GlobalLocalStep, RotaryCosSin
from kvsieve.ops.rope import half_cos_sin, half_cos_sin64, rotary_table
from kvsieve.parts.actions.evict_merge import EvictThenMerge
from kvsieve.parts.scorers.global_local import GLOBAL, LOCAL_CUR, LOCAL_PAST, LOCAL_ROWS, GlobalLocal
from kvsieve.policies.policy import Policy

#: The Global-Local score's side data in the order ``merge.c`` takes them.
SIDES = (GLOBAL, LOCAL_PAST, LOCAL_CUR, LOCAL_ROWS)
#: Rows of a rotary cos/sin table when first built (it doubles past the newest position).
FIRST_ROWS = 4096


class MergeInPlace:
    """The pass's parameters for one policy, and the rotary cos/sin tables it reads (one per distinct table: the
    layers of most models share one)."""

    def __init__(self, policy: Policy):
        scorer, action = policy.scorer, policy.action
        assert type(scorer) is GlobalLocal and type(action) is EvictThenMerge
        self.scorer: GlobalLocal = scorer
        self.action: EvictThenMerge = action
        self._tables: dict[tuple[Any, ...], RotaryCosSin] = {}
        self._layer_keys: dict[int, tuple[Any, ...]] = {}  # each layer's table, by its frequencies and factor
        self._steps: dict[int, GlobalLocalStep] = {}  # by budget: the parts' parameters do not change

    @staticmethod
    def applies(policy: Policy) -> bool:
        """Exactly EMS's scorer and action (not a subclass); the engine checks at each step that the pass is built
        (:func:`kvsieve.native.merge_lowest.available`) and the step runs on the CPU."""
        return type(policy.scorer) is GlobalLocal and type(policy.action) is EvictThenMerge

    def step(self, budget: int) -> GlobalLocalStep:
        """The pass's parameters for a layer keeping ``budget`` entries per head (the action merges when
        ``⌊(γ − 1)·B⌋ ≥ 1``, :meth:`EvictThenMerge.tbm_counts`), made once per budget."""
        known = self._steps.get(budget)
        if known is not None:
            return known
        gamma = float(self.action.gamma)
        merges = math.isinf(gamma) or math.floor(budget * (gamma - 1.0)) >= 1
        scorer = self.scorer
        made = self._steps[budget] = GlobalLocalStep(scorer.window, scorer.kernel_size, scorer.use_global, merges,
                                                     float(self.action.tau))
        return made

    def rotary(self, config: Any, layer_idx: int, newest: int) -> RotaryCosSin:
        """The layer's rotary cos/sin table, unscaled, covering positions up to ``newest``
        (:func:`~kvsieve.ops.rope.half_cos_sin` over every position: the values the general step's
        :func:`~kvsieve.ops.rope.unrotate` computes for the positions it reads; and in float64,
        :func:`~kvsieve.ops.rope.half_cos_sin64`, those of its exact redundancy)."""
        key = self._layer_keys.get(layer_idx)
        if key is None:
            table = rotary_table(config, layer_idx)
            key = self._layer_keys[layer_idx] = (tuple(table.inv_freq.tolist()), table.scaling, table.rotary_dim)
        known = self._tables.get(key)
        if known is None or known.cos.shape[0] <= newest:
            table = rotary_table(config, layer_idx)
            rows = max(FIRST_ROWS, 2 * (newest + 1))
            if table.rotary_dim == 0:
                cos = sin = torch.zeros(rows, 0, dtype=torch.float32)
                cos64 = sin64 = torch.zeros(rows, 0, dtype=torch.float64)
            else:
                cos, sin = half_cos_sin(table, torch.arange(rows))
                cos64, sin64 = half_cos_sin64(table, torch.arange(rows))
            known = RotaryCosSin(cos.contiguous(), sin.contiguous(), cos64.contiguous(), sin64.contiguous(),
                                 float(table.scaling))
            self._tables[key] = known
        return known

    def drop(self, store: LayerStore, rows: torch.Tensor, candidates: int, reserve: int, budget: int, config: Any,
             layer_idx: int, newest: int) -> bool | None:
        """The step's observation, plan, merge and drop in place (as
        :meth:`~kvsieve.cache.store_compaction.StoreCompaction.merge_lowest` returns)."""
        return store.merge_lowest(rows, SIDES, MERGE_COUNT, candidates, reserve, self.step(budget),
                                  self.rotary(config, layer_idx, newest))


def decoding_counts(store: LayerStore) -> torch.Tensor | None:
    """The merge counts of a uniform store's held entries ``(batch, heads, L)``, a view of its side data, once some
    entry was merged (what :meth:`LayerStep.bias <kvsieve.core.step.LayerStep.bias>` takes ``log(count)`` of: the
    decoding pass takes it itself, :func:`kvsieve.native.decoding_rows.attend`); None before."""
    if MERGE_COUNT not in store.written_sides or MERGE_COUNT not in store.extras:
        return None
    return store.side_capacity_view(MERGE_COUNT).narrow(2, 0, store.max_length)
