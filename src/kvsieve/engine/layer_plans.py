"""Plans of one layer: does the schedule fire, the nominal budgets, and scores → counts → the action's plan.

Both a layer-scope allocator (planned right after the layer's forward) and a global one
(:mod:`kvsieve.engine.global_plans`, which reads budgets and nominal counts from here) go through it.
"""

from __future__ import annotations

import torch

from kvsieve.core.plan import DropOnePlan, Plan
from kvsieve.core.step import LayerStep
from kvsieve.models.architectures import ModelInfo
from kvsieve.parts.actions.base import Action
from kvsieve.parts.allocators.base import Allocator
from kvsieve.parts.scorers.base import Scorer
from kvsieve.policies.policy import Policy


class LayerPlans:
    """A policy's budgets and plans for one layer at a time (no state beyond the policy and the model)."""

    def __init__(self, policy: Policy, info: ModelInfo):
        self.policy = policy
        self.info = info
        self._budget_spec = policy.budget_spec
        self._window = self._budget_spec.window
        allocator, action = type(policy.allocator), type(policy.action)
        #: :meth:`_drop_one`'s nominal budgets, offsets and host counts per (layout, budget, protection, device)
        self._drop_tables: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = {}
        #: whether a plan that drops one entry per head is what allocate → Action.plan gives (see :meth:`_drop_one`)
        self._drops_one = (policy.budget is not None and allocator.allocate is Allocator.allocate
                           and allocator.nominal is Allocator.nominal and action.plan is Action.plan)

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

    def fires_decoding(self, layer_idx: int, held: int) -> bool:
        """:meth:`fires` at a decoding step of a store holding at most ``held`` entries per head (counted in entries:
        no byte budget)."""
        return self.policy.schedule.fires(True, held, self.layer_budget(layer_idx))

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
        if self._one_over(layer_idx, step):
            plan = self._drop_one(layer_idx, step)
            if plan is not None:
                return plan
        lengths, nominal = self.nominal(layer_idx, step)
        scores = scorer.score(step, nominal)
        counts = self.policy.allocator.allocate(scores, nominal, lengths)
        limit = self.policy.schedule.row_limit(step.is_decoding, self.layer_budget(layer_idx))
        if limit is not None:  # a row compacts only when it is over its own limit, whatever its neighbours hold
            counts = torch.where((lengths.amax(dim=1) > limit)[:, None], counts, lengths)
        if bool((counts >= lengths).all()):
            return None
        return self.policy.action.plan(scores, counts, step)

    def _one_over(self, layer_idx: int, step: LayerStep) -> bool:
        """Whether every head of this decoding step holds exactly one entry over its layer's budget, in a uniform
        store without padding (every-step decoding eviction: ``h2o``/``tova`` with ``schedule="decode"``)."""
        if not (self._drops_one and step.is_decoding and step.q_len == 1 and step.store.is_uniform):
            return False
        budget = self.layer_budget(layer_idx)
        limit = self.policy.schedule.row_limit(True, budget)
        return (budget is not None and step.store.max_length == budget + 1 and (limit is None or limit <= budget)
                and step.view.valid is None)

    def _drop_one(self, layer_idx: int, step: LayerStep) -> Plan | None:
        """The plan keeping all but each head's lowest-scoring entry, from one ``min``: what the uniform allocator
        and :meth:`Action.plan <kvsieve.parts.actions.base.Action.plan>` (top ``budget`` of ``budget + 1``) give
        whenever that lowest score is unique, without top-k, sort and the count arithmetic. A scorer whose
        protection is only its newest entries (:meth:`Scorer.kept_newest`) is read raw, the minimum taken over
        the older entries (no protection pass). None (the general path decides) when every entry is protected.

        Equal lowest scores: the **oldest** of them goes (``min`` returns the first; the entries are in position
        order), the same on every device, where the general path leaves the choice among equal scores to top-k.
        Nothing is read back to the host, so on a GPU an every-step eviction (``h2o``/``tova`` with
        ``schedule="decode"``) does not wait for the device at each layer and step. A NaN score (a model whose
        activations overflowed) counts as the lowest, so its entry is the one dropped.
        """
        scorer = self.policy.scorer
        assert scorer is not None
        budget = self.layer_budget(layer_idx)
        assert budget is not None
        batch, heads, length = step.store.batch, step.store.heads, step.store.max_length
        newest = scorer.kept_newest(budget) if type(scorer).score is Scorer.score else None
        key = (batch, heads, length, budget, newest, step.query.device)
        tables = self._drop_tables.get(key)
        if tables is None:
            device = step.query.device
            if len(self._drop_tables) >= 64:  # layer budgets (a pyramid) make one key per layer; lengths change rarely
                self._drop_tables.clear()
            tables = self._drop_tables[key] = (
                torch.full((batch, heads), budget, dtype=torch.long, device=device),
                torch.arange(length - 1, device=device),
                torch.full((batch * heads,), length - 1, dtype=torch.long),
            )
        nominal, offsets, counts = tables
        if newest is None:
            candidates = scorer.score(step, nominal)
        elif newest < length:  # the unprotected entries (kept_newest's contract: their raw scores are not +inf)
            candidates = scorer.raw(step, nominal)[..., : length - newest]
        else:
            return None
        dropped = candidates.argmin(dim=-1)  # the first of equal lowest scores: the oldest (no host read)
        return DropOnePlan(dropped.reshape(-1), counts.clone(), offsets)
