"""``random``: uniform random scores, seeded — the sanity floor (METHODS.md, Baselines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.policies.base import Policy, PolicyConfigError, is_int, protect_recent
from kvsieve.policies.registry import register


@register
@dataclass(frozen=True)
class RandomPolicy(Policy):
    """Keep a uniformly random subset of entries per head (plus the ``window`` newest).

    Deterministic: the generator is seeded with ``(seed, layer, forward index)``.
    """

    name: ClassVar[str] = "random"
    schedules: ClassVar[tuple[str, ...]] = ("prefill", "decode", "blockwise")
    seed: int = 0
    window: int = 0

    def validate(self) -> None:
        super().validate()
        if not is_int(self.seed) or self.seed < 0:
            raise PolicyConfigError(f"random: seed must be an int ≥ 0; got {self.seed!r}")

    def score(self, step: LayerStep) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step.layer_idx * 7919 + step.forward_index)
        noise = torch.rand(step.view.positions.shape, generator=generator).to(step.view.keys.device)
        return protect_recent(noise, step, self.window)
