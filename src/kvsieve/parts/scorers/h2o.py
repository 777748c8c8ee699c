"""``h2o`` scorer — Heavy-Hitter Oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", arXiv:2306.14048).

Score of entry ``j``: accumulated attention ``Σ_t A[t, j]`` over every query so far (Sec. 3.2; the
prompt's queries at prefill, plus each decoding query's row), kept per entry in the cache as side data
``h2o_acc`` (mean over the GQA group). The ``recent_ratio`` share of the head's budget is reserved for
the newest entries (the paper's 50/50 heavy/recent split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.store import SideSpec
from kvsieve.core.part import require_number
from kvsieve.core.preset import Preset
from kvsieve.core.step import COLUMN_SUMS, LayerStep
from kvsieve.ops.gqa import reduce_groups
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer, protect_recent

ACCUMULATOR = "h2o_acc"


@dataclass(frozen=True)
class AccumulatedAttention(Scorer):
    """Accumulated-attention heavy hitters plus a recent share ``recent_ratio × budget``."""

    name: ClassVar[str] = "h2o"
    SCHEDULES: ClassVar[tuple[str, ...]] = ALL_SCHEDULES
    NEEDS: ClassVar[frozenset[str]] = frozenset({COLUMN_SUMS})
    SIDE: ClassVar[tuple[SideSpec, ...]] = (SideSpec(ACCUMULATOR),)
    ACCUMULATES_ROWS: ClassVar[str | None] = ACCUMULATOR
    recent_ratio: float = 0.5

    def validate(self) -> None:
        require_number(self.name, "recent_ratio", self.recent_ratio, 0.0, 1.0)

    def observe(self, step: LayerStep) -> dict[str, torch.Tensor]:
        return {ACCUMULATOR: reduce_groups(step.all_column_sums(), step.kv_heads, "mean")}

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return step.view.extras[ACCUMULATOR]

    def protect(self, scores: torch.Tensor, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        recent = (nominal.double() * self.recent_ratio).long().to(scores.device)
        return protect_recent(scores, step, recent)

    def kept_newest(self, budget: int) -> int | None:
        return int(budget * self.recent_ratio)  # as protect's float64 product, floored


PRESETS = (Preset("h2o", "accumulated attention of all queries + a recent half", scorer=AccumulatedAttention()),)
