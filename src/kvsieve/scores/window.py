"""Observation-window score (SnapKV, Li et al. 2024, Eq. 1–2): ``Σ_{t∈window} A[t, j]``, then pooling."""

from __future__ import annotations

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.scores.gqa import reduce_groups
from kvsieve.scores.pooling import pool_scores


def window_scores(
    step: LayerStep, window: int, kernel_size: int, pooling: str, reduce: str = "mean"
) -> torch.Tensor:
    """SnapKV scores ``(batch, kv_heads, L)``: window attention summed over the window queries,
    pooled along the sequence, reduced over each GQA group."""
    rows = step.window_rows(max(window, 1))
    summed = rows.sum(dim=2)
    pooled = pool_scores(summed, kernel_size, pooling)
    return reduce_groups(pooled, step.info.num_kv_heads, reduce)
