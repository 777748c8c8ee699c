"""``snapkv`` scorer (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv:2404.14469).

Score: attention of the last ``window`` prompt queries summed over the window (Eq. 1), smoothed by
1-D pooling with ``kernel_size`` (Eq. 2; 5 by default, 7 for LongBench, 21 for RULER in ReST-KV),
averaged over each GQA group; the window itself is always kept. Prefill-once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.engine.step import WINDOW_ROWS, LayerStep
from kvsieve.parts.base import PolicyConfigError, require_choice, require_int
from kvsieve.parts.scorers.base import Scorer
from kvsieve.scores.window import window_scores


@dataclass(frozen=True)
class WindowAttention(Scorer):
    """Observation-window voting with pooling; keeps the window."""

    name: ClassVar[str] = "snapkv"
    NEEDS: ClassVar[frozenset[str]] = frozenset({WINDOW_ROWS})
    window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"

    def validate(self) -> None:
        require_int(self.name, "window", self.window, 0)
        if not isinstance(self.kernel_size, int) or isinstance(self.kernel_size, bool) or self.kernel_size < 1 \
                or self.kernel_size % 2 == 0:
            raise PolicyConfigError(f"{self.name}: kernel_size must be an odd int ≥ 1; got {self.kernel_size!r}")
        require_choice(self.name, "pooling", self.pooling, ("avgpool", "maxpool"))

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return window_scores(step, self.window, self.kernel_size, self.pooling)
