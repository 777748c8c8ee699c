"""``mark`` action — RocketKV-MT's stage 1 (RocketKV, Behnam et al., 2025, arXiv:2502.14051,
Sec. 3.5): the plan's kept entries are *marked* (side datum ``stage1_keep``), nothing is deleted.

Each prompt (turn) re-filters the whole history: the scorer and allocator plan over every held entry as
for eviction, and the marks are rewritten — kept entries True, all others False; entries appended later
(generated tokens, the next turn's prompt) start True. The ``hsa`` selector with ``filtered=True`` then
selects among the marked entries only. Memory equals the full cache (plus one bool per entry and the
members' page min/max).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.member_pages import STAGE1_KEEP
from kvsieve.cache.store import LayerStore, SideSpec
from kvsieve.core.plan import Plan
from kvsieve.parts.actions.base import Action


@dataclass(frozen=True)
class Mark(Action):
    """Mark the plan's kept entries as this turn's stage-1 members; delete nothing."""

    name: ClassVar[str] = "mark"
    SIDE: ClassVar[tuple[SideSpec, ...]] = (STAGE1_KEEP,)
    deletes: ClassVar[bool] = False

    def apply(self, store: LayerStore, plan: Plan) -> None:
        index, valid, length = store.gather_index()
        keep = plan.keep.to(index.device)
        counts = plan.counts.to(index.device)
        width = keep.shape[1]
        taken = (torch.arange(width, device=index.device)[None, :] < counts[:, None]).long()
        marks = torch.zeros(store.segments, length, dtype=torch.long, device=index.device)
        marks = marks.scatter_add(1, keep.clamp(max=max(length - 1, 0)), taken) > 0  # filler never unmarks
        target = store.extras[STAGE1_KEEP.name]
        target.index_put_((index[valid],), marks[valid])
        store.invalidate_view()
        for hook in store.hooks:
            hook.after_layout(store)
