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


def reads_host_cheaply(device: torch.device) -> bool:
    """Whether reading a tensor's value back to the host costs no wait on ``device`` (the CPU)."""
    return device.type == "cpu"


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
        #: One budget per head of a layer, the allocator's defaults (no per-head or global arithmetic).
        self.uniform_budget = (policy.budget is not None and allocator.allocate is Allocator.allocate
                               and allocator.nominal is Allocator.nominal)
        self._drops_one = self.uniform_budget and action.plan is Action.plan

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

    def accumulator(self) -> str | None:
        """The side data a decoding step that drops one entry per head may observe, plan and drop from in one pass
        (:meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_lowest`): the scorer's
        :attr:`~kvsieve.parts.scorers.base.Scorer.ACCUMULATES_ROWS` (H2O's), when the class declaring it observes,
        scores and protects (only its newest entries) and the plan is :meth:`_drop_one`'s; None otherwise."""
        scorer = self.policy.scorer
        name = getattr(scorer, "ACCUMULATES_ROWS", None)
        if name is None or not self._declared_by_scoring_class("ACCUMULATES_ROWS", ("observe",)):
            return None
        return name

    def scores_from_row(self) -> bool:
        """Whether such a step may instead plan and drop from the scores of the query's row alone
        (:meth:`~kvsieve.parts.scorers.base.Scorer.scores_from_row`, TOVA's;
        :meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_lowest_scored`): the class defining it scores and
        protects, nothing is observed, and the plan is :meth:`_drop_one`'s."""
        scorer = self.policy.scorer
        return (scorer is not None and type(scorer).observe is Scorer.observe
                and type(scorer).scores_from_row is not Scorer.scores_from_row
                and self._declared_by_scoring_class("scores_from_row", ()))

    def _declared_by_scoring_class(self, attribute: str, methods: tuple[str, ...]) -> bool:
        """The plan is :meth:`_drop_one`'s, and the scorer class that defines ``attribute`` is the one whose
        ``methods``, :meth:`raw`, :meth:`protect` and :meth:`kept_newest` run (a subclass overriding any scores
        otherwise)."""
        scorer = self.policy.scorer
        if scorer is None or not self._drops_one or type(scorer).score is not Scorer.score:
            return False
        owner = next(cls for cls in type(scorer).__mro__ if attribute in vars(cls))
        return all(getattr(type(scorer), method) is getattr(owner, method)
                   for method in (*methods, "raw", "protect", "kept_newest"))

    def lowest_candidates(self, layer_idx: int, held: int) -> int | None:
        """At a decoding step whose store holds ``held`` entries per head once the step's entry is appended (uniform,
        no padding): how many older entries of each head compete for the one drop of :meth:`_drop_one` (the newest
        ones are protected); None when this step does not plan exactly that."""
        budget = self.layer_budget(layer_idx)
        if budget is None or held != budget + 1 or not self.policy.schedule.fires(True, held, budget):
            return None
        limit = self.policy.schedule.row_limit(True, budget)
        scorer = self.policy.scorer
        newest = None if scorer is None or (limit is not None and limit > budget) else scorer.kept_newest(budget)
        return None if newest is None or newest >= held else held - newest

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
        """The plan keeping all but one entry of each head: exactly what the uniform allocator and
        :meth:`Action.plan <kvsieve.parts.actions.base.Action.plan>` (top ``budget`` of ``budget + 1``) give, without
        the allocator arithmetic, the host copy of the counts, the filler mask and the sort. None (the general path
        decides) when every entry is protected (:meth:`Scorer.kept_newest`), and on the CPU when some head's lowest
        score is tied.

        * **On the CPU** (:func:`reads_host_cheaply`): each head's lowest score (``min``); a scorer whose protection is
          only its newest entries is read raw over the older ones (no protection pass). One host read checks that
          every lowest score is unique; a tie goes to the general path, so top-k decides equal scores as there.
        * **Elsewhere (a GPU)**, where a host read waits for the device at every layer and step: the same ``topk`` call
          on the same protected scores as the general path (equal scores decided as there), and the one index it
          leaves out is the sum of all indices minus the sum of the kept ones. Nothing is read back. (On the CPU this
          costs ~2% of an h2o step more than the minimum: the protection pass and a top-k of ``budget`` entries.)
        """
        scorer = self.policy.scorer
        assert scorer is not None
        budget = self.layer_budget(layer_idx)
        assert budget is not None
        batch, heads, length = step.store.batch, step.store.heads, step.store.max_length
        newest = scorer.kept_newest(budget) if type(scorer).score is Scorer.score else None
        if newest is not None and newest >= length:
            return None
        device = step.query.device
        key = (batch, heads, length, budget, device)
        tables = self._drop_tables.get(key)
        if tables is None:
            if len(self._drop_tables) >= 64:  # layer budgets (a pyramid) make one key per layer; lengths change rarely
                self._drop_tables.clear()
            tables = self._drop_tables[key] = (
                torch.full((batch, heads), budget, dtype=torch.long, device=device),
                torch.arange(length - 1, device=device),
                torch.full((batch * heads,), length - 1, dtype=torch.long),
                torch.ones((batch, heads), dtype=torch.long, device=device),
            )
        nominal, offsets, counts, ones = tables
        if reads_host_cheaply(device):
            # a scorer protecting only its newest entries: raw over the older ones (their raw scores are not +inf)
            candidates = (scorer.score(step, nominal) if newest is None
                          else scorer.raw(step, nominal)[..., : length - newest])
            lowest, dropped = candidates.min(dim=-1)
            if not torch.equal((candidates == lowest[..., None]).sum(dim=-1), ones):  # a tie: top-k's choice
                return None
            return DropOnePlan(dropped.reshape(-1), counts.clone(), offsets)
        scores = scorer.score(step, nominal)
        kept = torch.topk(scores.reshape(batch * heads, length), budget, dim=-1, sorted=True).indices  # as top_entries
        dropped = (length * (length - 1) // 2) - kept.sum(dim=-1)  # the one index of 0 … length - 1 not kept
        return DropOnePlan(dropped, counts.clone(), offsets)
