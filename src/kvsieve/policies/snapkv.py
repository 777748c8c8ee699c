"""``snapkv`` (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv:2404.14469).

Score: attention of the last ``window`` prompt queries summed over the window (Eq. 1), smoothed by
1-D pooling with ``kernel_size`` (Eq. 2; 5 by default, 7 for LongBench, 21 for RULER in ReST-KV),
averaged over each GQA group; the window itself is always kept. Prefill-once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.policies.base import Policy, PolicyConfigError, is_int, protect_recent
from kvsieve.policies.registry import register
from kvsieve.scores.window import window_scores


@register
@dataclass(frozen=True)
class SnapKV(Policy):
    """Observation-window voting with pooling; keeps the window."""

    name: ClassVar[str] = "snapkv"
    schedules: ClassVar[tuple[str, ...]] = ("prefill", "blockwise")
    window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"

    def validate(self) -> None:
        super().validate()
        if not is_int(self.kernel_size) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise PolicyConfigError(f"{self.name}: kernel_size must be an odd int ≥ 1; got {self.kernel_size!r}")
        if self.pooling not in ("avgpool", "maxpool"):
            raise PolicyConfigError(f"{self.name}: pooling must be 'avgpool' or 'maxpool'; got {self.pooling!r}")

    def raw_scores(self, step: LayerStep) -> torch.Tensor:
        """Window scores before the window is protected, ``(batch, kv_heads, L)``."""
        return window_scores(step, self.window, self.kernel_size, self.pooling)

    def score(self, step: LayerStep) -> torch.Tensor:
        return protect_recent(self.raw_scores(step), step, self.window)
