"""``streaming_llm`` (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first ``sinks`` entries (attention sinks) and the most recent ``budget - sinks``; no
scoring. Works at prefill and, with ``schedule="decode"``, as a rolling cache during generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.policies.base import Policy, PolicyConfigError, is_int
from kvsieve.policies.registry import register


@register
@dataclass(frozen=True)
class StreamingLLM(Policy):
    """Attention sinks + recent window. Score: +inf for the first ``sinks`` entries, else position."""

    name: ClassVar[str] = "streaming_llm"
    schedules: ClassVar[tuple[str, ...]] = ("prefill", "decode", "blockwise")
    sinks: int = 4

    def validate(self) -> None:
        super().validate()
        if not is_int(self.sinks) or self.sinks < 0:
            raise PolicyConfigError(f"streaming_llm: sinks must be an int ≥ 0; got {self.sinks!r}")
        if self.budget is not None and self.sinks > self.budget:
            raise PolicyConfigError(f"streaming_llm: sinks ({self.sinks}) must not exceed budget ({self.budget})")

    def score(self, step: LayerStep) -> torch.Tensor:
        offsets = torch.arange(step.view.positions.shape[-1], device=step.view.keys.device)
        scores = step.view.positions.float().clone()
        scores = scores.masked_fill(offsets.view(1, 1, -1) < self.sinks, float("inf"))
        return scores.masked_fill(~step.entry_valid(), float("-inf"))
