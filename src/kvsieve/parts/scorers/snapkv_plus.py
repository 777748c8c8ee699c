"""``snapkv_plus`` scorer — RocketKV's stage 1, "SnapKV++" (Behnam et al., 2025, arXiv:2502.14051, Sec. 3.3).

SnapKV's observation-window score (:class:`~kvsieve.parts.scorers.snapkv.WindowAttention`) with
RocketKV's settings: GQA group-wise selection from the scores **summed** over the query heads of the
group (as Ada-KV), window 32, **max pooling with kernel 63** (the paper's empirically larger kernel for
coarse first-stage eviction); the window is kept. Summing instead of averaging ranks identically (a
factor ``g``); the sum is what the paper specifies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.core.step import LayerStep
from kvsieve.parts.scorers.snapkv import WindowAttention, window_scores


@dataclass(frozen=True)
class GroupWindowAttention(WindowAttention):
    """SnapKV++: group-summed window attention, max-pooled with kernel 63; keeps the window."""

    name: ClassVar[str] = "snapkv_plus"
    window: int = 32
    kernel_size: int = 63
    pooling: str = "maxpool"

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return window_scores(step, self.window, self.kernel_size, self.pooling, reduce="sum")
