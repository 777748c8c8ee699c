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

Budgets, floors and protected entries, per batch row (rows are independent requests: what a row keeps
depends only on its own scores and lengths, never on the other rows of the batch or their padding):

* the row's total is the sum of its heads' nominal budgets ``Σ_h B_h`` (``H·B`` for a ``budget``; for a
  ``ratio``, ``B_h = ⌈n_h·(1 - ratio)⌉`` from the ``n_h`` entries head ``h`` holds);
* every entry the scorer protects (``+inf``: the observation window, sinks, a recent share) is kept,
  with either floor: a head keeps at least ``min(max(floor_h, protected_h), n_h)`` entries, and the rest
  of the total goes to the highest remaining scores of the row's heads (ties to the lower head);
* **a target smaller than the protected window** (a ratio of a short prompt, e.g. 5 entries with
  ``ratio=0.8`` and ``window=4``): the window is kept all the same, so each head keeps
  ``max(target, protected)`` entries clamped to what it holds, and the row holds
  ``max(Σ_h B_h, Σ_h min(max(floor_h, protected_h), n_h))`` entries in all. With an absolute ``budget``
  the window never exceeds it (validated), so a row never holds more than ``H·B`` entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.core.part import require_choice, require_number
from kvsieve.core.preset import Preset
from kvsieve.ops.adaptive_counts import adaptive_counts
from kvsieve.parts.allocators.base import Allocator
from kvsieve.parts.scorers.snapkv import WindowAttention


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
        protected = torch.isposinf(scores).sum(dim=-1)
        total = nominal.sum(dim=1)
        if self.floor == "budget":
            floor = (nominal.double() * self.alpha).long()
        else:
            outside = (nominal - protected).clamp(min=0)
            floor = protected + (outside.double() * self.alpha).long()
        return adaptive_counts(scores, total, floor, lengths)


PRESETS = (
    Preset("adakv", "any base score (snapkv by default), budget split across the heads of a layer",
           scorer=WindowAttention(), allocator=Adaptive(), aliases={"base": "scorer"}, routes={"alpha": "allocator"}),
)
