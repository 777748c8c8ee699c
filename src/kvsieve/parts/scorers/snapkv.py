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

from kvsieve.core.part import require_choice, require_int, require_odd_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import WINDOW_ROWS, LayerStep
from kvsieve.ops.gqa import reduce_groups
from kvsieve.ops.pooling import pool_scores
from kvsieve.parts.scorers.base import Scorer


def window_scores(
    step: LayerStep, window: int, kernel_size: int, pooling: str, reduce: str = "mean"
) -> torch.Tensor:
    """SnapKV scores ``(batch, kv_heads, L)``: window attention summed over the window queries,
    pooled along the sequence, reduced over each GQA group.

    As in the reference code (``attn[..., -w:, :-w].sum(-2)`` then pooling), only the prefix votes are
    pooled: the window's own entries get 0 before pooling, so their large self-attention does not leak
    into the neighbouring prefix scores (the caller protects the window anyway).
    """
    summed = step.window_column_sums(max(window, 1))
    first_window_position = step.query_positions[-min(max(window, 1), step.q_len)]
    in_window = (step.view.positions >= first_window_position).repeat_interleave(step.groups, dim=1)
    summed = summed.masked_fill(in_window, 0.0)
    pooled = pool_scores(summed, kernel_size, pooling)
    return reduce_groups(pooled, step.kv_heads, reduce)


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
        require_odd_int(self.name, "kernel_size", self.kernel_size)
        require_choice(self.name, "pooling", self.pooling, ("avgpool", "maxpool"))

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return window_scores(step, self.window, self.kernel_size, self.pooling)


PRESETS = (
    Preset("snapkv", "observation-window attention (w=32), pooled (kernel 5), window kept", scorer=WindowAttention()),
)
