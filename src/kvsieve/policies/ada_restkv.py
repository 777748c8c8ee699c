"""``ada_restkv`` — ReST-KV scores with AdaKV's head-wise allocation (ReST-KV, Chen et al. 2025,
``papers/restkv.txt``, App. C, Table 6; Ada-KV, Feng et al. 2024, arXiv:2407.11550).

Scores are :class:`~kvsieve.policies.restkv.RestKV`'s (Eq. 7, 9, 13) with all its fields; the layer's
``H·B`` entries are then split across its KV heads by a global top-k with a floor of ``α·B`` per head
(``floor_alpha`` = 0.2, renamed because ``alpha`` is ReST-KV's EMA factor). ``adakv`` with
``base="restkv"`` is the same allocation with ReST-KV's default parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.policies.adakv import AdaKV
from kvsieve.policies.base import PolicyConfigError
from kvsieve.policies.registry import register
from kvsieve.policies.restkv import RestKV


@register
@dataclass(frozen=True)
class AdaRestKV(RestKV):
    """ReST-KV with head-wise adaptive budgets (ragged per-head storage, real memory savings)."""

    name: ClassVar[str] = "ada_restkv"
    schedules: ClassVar[tuple[str, ...]] = tuple(s for s in RestKV.schedules if s in AdaKV.schedules)
    floor_alpha: float = 0.2

    def validate(self) -> None:
        super().validate()
        if isinstance(self.floor_alpha, bool) or not isinstance(self.floor_alpha, int | float):
            raise PolicyConfigError(f"{self.name}: floor_alpha must be a number in [0, 1]; got {self.floor_alpha!r}")
        if not 0.0 <= self.floor_alpha <= 1.0:
            raise PolicyConfigError(f"{self.name}: floor_alpha must be in [0, 1]; got {self.floor_alpha!r}")

    def allocate(self, scores: torch.Tensor, step: LayerStep) -> torch.Tensor:
        allocator = AdaKV(
            budget=self.budget, ratio=self.ratio, alpha=self.floor_alpha, window=self.window, base="restkv"
        )
        return allocator.allocate(scores, step)
