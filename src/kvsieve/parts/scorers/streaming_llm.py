"""``streaming_llm`` scorer (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
arXiv:2309.17453).

Keeps the first ``sinks`` entries (attention sinks) and the most recent ``budget - sinks``; no
attention is read. Works at prefill and, with the ``decode`` schedule, as a rolling cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.core.part import PolicyConfigError, require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec


@dataclass(frozen=True)
class Sinks(Scorer):
    """Attention sinks + recent window. Score: +inf for the first ``sinks`` entries, else the position."""

    name: ClassVar[str] = "streaming_llm"
    SCHEDULES: ClassVar[tuple[str, ...]] = ALL_SCHEDULES
    sinks: int = 4

    def validate(self) -> None:
        require_int(self.name, "sinks", self.sinks, 0)

    def check(self, spec: BudgetSpec) -> None:
        if spec.budget is not None and self.sinks > spec.budget:
            raise PolicyConfigError(
                f"{spec.name}: sinks ({self.sinks}) must not exceed budget ({spec.budget}); "
                f"the streaming_llm score keeps {self.sinks} attention sinks: pass sinks=... ≤ {spec.budget} "
                "or a larger budget"
            )

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return step.view.positions.float().clone()

    def protect(self, scores: torch.Tensor, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(offsets.view(1, 1, -1) < self.sinks, math.inf)
        return scores.masked_fill(~step.entry_valid(), -math.inf)


PRESETS = (Preset("streaming_llm", "4 attention sinks + the most recent entries", scorer=Sinks()),)
