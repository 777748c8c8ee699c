"""``h2o`` — Heavy-Hitter Oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", arXiv:2306.14048).

Score of entry ``j``: accumulated attention ``Σ_t A[t, j]`` over every query so far (Sec. 3.2; the
prompt's queries at prefill, plus each decoding query's row), kept per entry in the cache as side data
``h2o_acc`` (mean over the GQA group). The ``recent_ratio`` share of the budget is reserved for the
newest entries (the paper's 50/50 heavy/recent split). With ``schedule="decode"`` one entry is evicted
per step once the budget is reached (``buffer`` amortises this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.policies.base import Policy, PolicyConfigError, protect_recent
from kvsieve.policies.registry import register
from kvsieve.scores.gqa import reduce_groups

ACCUMULATOR = "h2o_acc"


@register
@dataclass(frozen=True)
class H2O(Policy):
    """Accumulated-attention heavy hitters plus a recent window of ``recent_ratio × budget``."""

    name: ClassVar[str] = "h2o"
    schedules: ClassVar[tuple[str, ...]] = ("prefill", "decode", "blockwise")
    extras: ClassVar[tuple[str, ...]] = (ACCUMULATOR,)
    recent_ratio: float = 0.5

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise PolicyConfigError(f"h2o: recent_ratio must be in [0, 1]; got {self.recent_ratio!r}")

    def observe(self, step: LayerStep) -> None:
        step.store.ensure_extra(ACCUMULATOR)
        sums = reduce_groups(step.all_column_sums(), step.info.num_kv_heads, "mean")
        step.store.add_dense(ACCUMULATOR, sums)

    def score(self, step: LayerStep) -> torch.Tensor:
        accumulated = step.store.dense().extras[ACCUMULATOR]
        target = self.target(step.lengths().cpu(), step.layer_idx, step.info.num_layers)
        recent = (target.double() * self.recent_ratio).long().to(accumulated.device)
        return protect_recent(accumulated, step, recent)
