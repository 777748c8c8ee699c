"""Plans of one layer: does the schedule fire, the nominal budgets, and scores → counts → the action's plan.

Both a layer-scope allocator (planned right after the layer's forward) and a global one
(:mod:`kvsieve.engine.global_plans`, which reads budgets and nominal counts from here) go through it.
"""

from __future__ import annotations

import torch

from kvsieve.core.plan import Plan
from kvsieve.core.step import LayerStep
from kvsieve.models.architectures import ModelInfo
from kvsieve.policies.policy import Policy


class LayerPlans:
    """A policy's budgets and plans for one layer at a time (no state beyond the policy and the model)."""

    def __init__(self, policy: Policy, info: ModelInfo):
        self.policy = policy
        self.info = info
        self._budget_spec = policy.budget_spec
        self._window = self._budget_spec.window

    def layer_budget(self, layer_idx: int) -> int | None:
        """The layer's budget (entries per head) under the allocator; None without a fixed budget."""
        budget = self.policy.budget
        if budget is None:
            return None
        return self.policy.allocator.layer_budget(budget, layer_idx, self.info.num_layers, self._window)

    def fires(self, layer_idx: int, step: LayerStep) -> bool:
        """Whether the schedule compacts this layer now."""
        held = step.store.max_length
        if getattr(self.policy.action, "shares", ()):  # mixed precision: the budget is bytes, in full entries
            held = step.store.max_full_entry_units()
        return self.policy.schedule.fires(step.is_decoding, held, self.layer_budget(layer_idx))

    def nominal(self, layer_idx: int, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries held and the nominal budget per (batch, KV head), both on the entries' device.

        The allocator's budget arithmetic runs on the store's host copy of the lengths (exact float64 ratio
        rounding on any device) and is copied to the device: no device-to-host read on the planning path.
        """
        lengths = step.lengths()
        nominal = self.policy.allocator.nominal(
            self._budget_spec, step.store.lengths(), layer_idx, self.info.num_layers, self._window
        ).to(lengths.device, non_blocking=True)
        return lengths, nominal

    def plan(self, layer_idx: int, step: LayerStep) -> Plan | None:
        """Score, allocate and plan one layer; None when every entry is kept."""
        scorer = self.policy.scorer
        assert scorer is not None
        lengths, nominal = self.nominal(layer_idx, step)
        scores = scorer.score(step, nominal)
        counts = self.policy.allocator.allocate(scores, nominal, lengths)
        limit = self.policy.schedule.row_limit(step.is_decoding, self.layer_budget(layer_idx))
        if limit is not None:  # a row compacts only when it is over its own limit, whatever its neighbours hold
            counts = torch.where((lengths.amax(dim=1) > limit)[:, None], counts, lengths)
        if bool((counts >= lengths).all()):
            return None
        return self.policy.action.plan(scores, counts, step)
