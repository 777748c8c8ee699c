"""Action: what happens to the entries a plan does not keep.

``plan(scores, counts, step)`` turns scores and per-head counts into a :class:`~kvsieve.core.plan.Plan`;
``apply(store, plan)`` executes it. The engine calls both; actions never touch the store otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.store import LayerStore, SideSpec
from kvsieve.core.part import Part
from kvsieve.core.plan import Plan
from kvsieve.core.step import LayerStep
from kvsieve.ops.topk import top_entries


@dataclass(frozen=True)
class Action(Part):
    """Base action: evict — keep the ``counts`` highest-scoring entries of each head, free the rest."""

    kind: ClassVar[str] = "action"
    name: ClassVar[str] = "evict"
    #: Per-entry side data the action keeps (merge counts...).
    SIDE: ClassVar[tuple[SideSpec, ...]] = ()
    #: Whether applying a plan removes entries or loses precision (``mark`` only labels them).
    deletes: ClassVar[bool] = True
    #: Whether entries move into quantized tiers (:mod:`kvsieve.parts.actions.quantize`).
    quantizes: ClassVar[bool] = False
    #: What ``kvsieve list`` says a policy with this action does.
    effect: ClassVar[str] = "evicts"

    def side(self) -> tuple[SideSpec, ...]:
        return self.SIDE

    def plan(self, scores: torch.Tensor, counts: torch.Tensor, step: LayerStep) -> Plan:
        host = counts.cpu().reshape(-1)  # the plan's host copy also gives the kept width: one device read
        return Plan(top_entries(scores, counts, int(host.max()) if host.numel() else 0), host)

    def apply(self, store: LayerStore, plan: Plan) -> None:
        if plan.dropped is not None and store.is_uniform and not store.tiered:
            store.drop_one(plan.dropped)  # the same entries kept, with one index built from the dropped ones
        else:
            store.keep(plan.keep, plan.counts)

    def expanded(self, step: LayerStep) -> tuple[torch.Tensor, ...] | None:
        """A runtime view to attend to instead of the held entries (EMS w. pos); None: the held entries.

        ``(keys, values, positions, valid, bias)``, each ``(batch, kv_heads, n, ...)``.
        """
        return None


Evict = Action
