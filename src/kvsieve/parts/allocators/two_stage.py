"""``rocketkv_split`` allocator — stage-1 budget of RocketKV (Behnam et al., 2025, arXiv:2502.14051), Sec. 3.6.

The policy's ``budget`` is the *token budget* ``t`` per KV group (decoding traffic, not what is held).
A head holding ``N`` entries has compression ``c = N / t``, split ``r = min(0.2 + 0.06·log2 c, 0.8)``;
stage 1 keeps ``⌈N / c^r⌉`` entries (all of them when ``N ≤ t``), the second stage (HSA) gets the
remaining ``c^{1−r}``. ``N`` is the row's own length (rows are independent requests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.parts.allocators.base import Allocator

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec


def stage1_keep(lengths: torch.Tensor, budget: int) -> torch.Tensor:
    """Entries stage 1 keeps: ``⌈N / c^r⌉`` with ``c = N / t`` (``N`` when ``c ≤ 1``), same shape as ``lengths``."""
    n = lengths.double()
    ratio = (n / budget).clamp(min=1.0)
    split = (0.2 + 0.06 * torch.log2(ratio)).clamp(max=0.8)
    kept = torch.ceil(n / ratio.pow(split) - 1e-9).long()
    return torch.minimum(kept, lengths.long())


@dataclass(frozen=True)
class TwoStageSplit(Allocator):
    """Uniform stage-1 counts ``⌈N / c^r⌉`` from the token budget ``t`` (RocketKV Sec. 3.6)."""

    name: ClassVar[str] = "rocketkv_split"
    accepts_ratio: ClassVar[bool] = False
    SCHEDULES: ClassVar[tuple[str, ...]] = ("prefill",)

    def nominal(
        self, spec: BudgetSpec, lengths: torch.Tensor, layer_idx: int, num_layers: int, window: int
    ) -> torch.Tensor:
        assert spec.budget is not None
        return stage1_keep(lengths, spec.budget)
