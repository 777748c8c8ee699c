"""Global allocation (``allocator.scope == "global"``): score every managed layer, plan once per forward.

Each managed layer is scored when its forward runs; after the last managed layer the allocator divides
one budget among all of them (``allocate_global``) and every layer's plan is made and executed (or, for
a prompt, left waiting with :class:`~kvsieve.engine.deferral.Deferral`). Until then only the scores, the
counts and a one-query step are held — nothing is held longer than the forward. At a decoding step only
the batch rows whose total over every managed layer is over the budget (plus the schedule's slack)
compact: each row is its own request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvsieve.cache.store import LayerStore
from kvsieve.core.step import LayerStep
from kvsieve.engine.deferral import Deferral
from kvsieve.engine.layer_call import LayerCall, LayerState
from kvsieve.engine.layer_plans import LayerPlans
from kvsieve.engine.noop_warning import NoopWarning
from kvsieve.policies.policy import Policy


@dataclass
class _Pending:
    """A managed layer's scores waiting for a global allocation at the end of the forward."""

    layer: LayerState
    step: LayerStep
    scores: torch.Tensor
    nominal: torch.Tensor
    lengths: torch.Tensor
    sliding_window: int | None
    statistic: torch.Tensor | None


class GlobalPlans:
    """The scores of one forward's managed layers, and the plans made from them after the last one."""

    def __init__(
        self, policy: Policy, managed: tuple[int, ...], plans: LayerPlans, deferral: Deferral, warning: NoopWarning
    ):
        self.policy = policy
        self.managed = managed
        self._plans = plans
        self._deferral = deferral
        self._warning = warning
        self._pending: list[_Pending] = []
        self._fire_forward = False
        self._rows_over: torch.Tensor | None = None
        #: The decoding forward whose plan was decided at its first managed layer (its position) and whether it fires.
        self._decided: tuple[int, bool] | None = None

    def clear(self) -> None:
        """Forget the scores of an unfinished forward (the cache was reset)."""
        self._pending = []

    def collect(self, call: LayerCall, step: LayerStep, layers: Sequence[LayerState]) -> bool:
        """Score this layer now, decide for all layers after the last managed one.

        ``layers`` are the cache's layers (their stores total a row's entries). Returns whether the layer's
        sliding-window trim waits for the plan (it does whenever the layer was scored).
        """
        layer = call.layer
        if layer.layer_idx == self.managed[0]:
            self._pending = []
            self._rows_over = self._rows_over_total(step, layers)
            self._fire_forward = self._rows_over is None or bool(self._rows_over.any())
            self._decided = (step.first_position, self._fire_forward) if step.is_decoding else None
        deferred = False
        if self._fire_forward:
            scorer = self.policy.scorer
            assert scorer is not None
            lengths, nominal = self._plans.nominal(layer.layer_idx, step)
            scores = scorer.score(step, nominal)
            statistic = self.policy.allocator.layer_statistic(step)
            step.query = step.query[:, :, -1:]  # hold nothing big until the end of the forward
            step._memo = {"lengths": lengths}
            self._pending.append(_Pending(layer, step, scores, nominal, lengths, call.sliding_window,
                                          statistic))
            deferred = True
        if layer.layer_idx == self.managed[-1] and self._pending:
            self._act()
        return deferred

    def fires_at_decoding(self, layer_idx: int, store: LayerStore, seen: int, layers: Sequence[LayerState]) -> bool:
        """Before a one-token decoding step's append to ``store`` (layer ``layer_idx``, ``seen`` tokens so far):
        whether this forward plans — some row over its total once every managed layer appended — decided at the
        first managed layer (as :meth:`collect` decides it) and kept for the forward's other layers; True when not
        decided for this forward (the general step then decides)."""
        if layer_idx == self.managed[0]:
            rows = self._rows_over_held(store, 1, layers, appended=False)
            self._decided = (seen, bool(rows.any()))
        decided = self._decided
        return decided is None or decided[0] != seen or decided[1]

    def _rows_over_total(self, step: LayerStep, layers: Sequence[LayerState]) -> torch.Tensor | None:
        """Rows (host bool ``(batch,)``) whose total is over the global budget (plus slack) at a decoding
        step; None: every row (a prompt forward, when the schedule compacts prompts). Each row is its own
        request: a row under its own limit keeps everything, whatever the other rows hold."""
        if not step.is_decoding:
            fires = self.policy.schedule.fires_total(False, 0, None, 0)
            return None if fires else torch.zeros(step.store.batch, dtype=torch.bool)
        return self._rows_over_held(step.store, step.q_len, layers, appended=True)

    def _rows_over_held(self, store: LayerStore, q_len: int, layers: Sequence[LayerState], appended: bool
                        ) -> torch.Tensor:
        """:meth:`_rows_over_total` of a decoding step adding ``q_len`` entries per head to every managed layer,
        from ``store`` (this layer's: ``appended`` already or not yet) and the other managed layers' stores."""
        budget = self.policy.budget
        total_budget = None if budget is None else sum(self._plans.layer_budget(i) or 0 for i in self.managed)
        heads = store.heads
        mixed = bool(getattr(self.policy.action, "shares", ()))  # a byte budget: count bytes, in full entries

        def held(store: LayerStore) -> list[int]:
            if mixed:
                units = torch.ceil(store.full_entry_units().view(store.batch, store.heads).sum(dim=1)).long()
                return [int(unit) for unit in units.tolist()]
            return store.row_totals()  # Python ints, kept by the store: no tensor operation per layer and step

        # held by this layer (after its append), plus what the other managed layers will hold after theirs
        appends = q_len * heads * (len(self.managed) - (1 if appended else 0))
        totals = [total + appends for total in held(store)]
        for other in (layers[i].store for i in self.managed):
            if other is not None and other is not store:
                totals = [total + more for total, more in zip(totals, held(other), strict=True)]
        # the slack (``buffer`` per head) counts every head of every managed layer, as the budget does
        managed_heads = heads * len(self.managed)
        limit = (total_budget or 0) * heads
        fires = self.policy.schedule.fires_total
        return torch.tensor([fires(True, total, limit, managed_heads) for total in totals])

    def _act(self) -> None:
        """Allocate across the collected layers, then plan and execute (or defer) each layer's plan."""
        pending, self._pending = self._pending, []
        statistics = [p.statistic for p in pending]
        counts = self.policy.allocator.allocate_global(
            [p.scores for p in pending], [p.nominal for p in pending], [p.lengths for p in pending],
            None if any(s is None for s in statistics) else statistics,  # type: ignore[misc]
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
            if self._deferral.defers(item.step):
                self._deferral.wait(item.layer.layer_idx, item.step.store, plan, trim)
                continue
            if plan is not None:
                self._deferral.act(item.step.store, plan, item.step.is_decoding)
            if trim is not None:
                self._deferral.trim(item.step.store, trim, item.step.is_decoding)
        if pending and not pending[-1].step.is_decoding:
            self._warning.warn_if_noop(compressed, pending[-1].layer.seen)
