"""``random`` scorer: uniform random scores, seeded — the sanity floor (a baseline of this library, from no paper)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.core.part import require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer


@dataclass(frozen=True)
class RandomScores(Scorer):
    """A uniformly random subset per head (plus the ``window`` newest).

    Deterministic: the generator is seeded with ``(seed, layer, forward index)``.
    """

    name: ClassVar[str] = "random"
    SCHEDULES: ClassVar[tuple[str, ...]] = ALL_SCHEDULES
    seed: int = 0
    window: int = 0

    def validate(self) -> None:
        require_int(self.name, "seed", self.seed, 0)
        require_int(self.name, "window", self.window, 0)

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step.layer_idx * 7919 + step.forward_index)
        noise = torch.rand(step.view.positions.shape, generator=generator)
        return noise.to(step.view.keys.device)


PRESETS = (Preset("random", "a seeded uniform random subset", scorer=RandomScores()),)
