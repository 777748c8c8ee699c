"""``adaptive`` allocator — head-wise budgets within a layer (Feng et al. 2024, "Ada-KV: Optimizing KV Cache
Eviction by Adaptive Budget Allocation", arXiv:2407.11550, Alg. 1 with the safeguard floor of Sec. 4.3).

Within one layer, the ``H·B`` entries of a batch row go to the globally highest scores over all its
heads, after each head is first guaranteed a floor. ``floor="outside_window"`` (default, as the
official code): the entries the scorer always keeps (its window, ``+inf``) plus ``⌊α·(B - w)⌋`` more —
the floor guarantees ``α·(B - w)`` entries *outside* the window. ``floor="budget"`` (kvsieve ≤ 0.1 and
NVIDIA kvpress): ``⌊α·B⌋`` entries counting the window, so with a 32-entry window the floor is empty
below B = 160 and a head can keep nothing but its window. The rest of the allocation (floor first,
then the global top over every head) is the kvpress form; the official code instead blends
``round((1 - α)·count_h + ⌊α·(B - w)⌋)`` from the unfloored top-``H·(B - w)`` counts.
Heads really hold different numbers of entries (ragged storage), so the memory saved is real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.budgets.adaptive import adaptive_counts
from kvsieve.parts.allocators.base import Allocator
from kvsieve.parts.base import require_choice, require_number


@dataclass(frozen=True)
class Adaptive(Allocator):
    """AdaKV head-wise allocation over any score (ragged per-head storage)."""

    name: ClassVar[str] = "adaptive"
    SCHEDULES: ClassVar[tuple[str, ...]] = ("prefill", "blockwise")
    aliases: ClassVar[dict[str, str]] = {"floor_alpha": "alpha"}
    alpha: float = 0.2
    floor: str = "outside_window"

    def validate(self) -> None:
        require_number(self.name, "alpha", self.alpha, 0.0, 1.0)
        require_choice(self.name, "floor", self.floor, ("outside_window", "budget"))

    def allocate(self, scores: torch.Tensor, nominal: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        per_head = nominal[:, 0]
        total = per_head * lengths.shape[1]
        if self.floor == "budget":
            floor = (per_head.double() * self.alpha).long()
        else:
            protected = torch.isposinf(scores).sum(dim=-1)
            outside = (per_head[:, None] - protected).clamp(min=0)
            floor = protected + (outside.double() * self.alpha).long()
        return adaptive_counts(scores, total, floor, lengths)
