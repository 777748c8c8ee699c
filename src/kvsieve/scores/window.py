"""Observation-window score (SnapKV, Li et al. 2024, Eq. 1–2): ``Σ_{t∈window} A[t, j]``, then pooling."""

from __future__ import annotations

import torch

from kvsieve.engine.step import LayerStep
from kvsieve.scores.gqa import reduce_groups
from kvsieve.scores.pooling import pool_scores


def window_scores(
    step: LayerStep, window: int, kernel_size: int, pooling: str, reduce: str = "mean"
) -> torch.Tensor:
    """SnapKV scores ``(batch, kv_heads, L)``: window attention summed over the window queries,
    pooled along the sequence, reduced over each GQA group.

    As in the reference code (``attn[..., -w:, :-w].sum(-2)`` then pooling), only the prefix votes are
    pooled: the window's own entries get 0 before pooling, so their large self-attention does not leak
    into the neighbouring prefix scores (the caller protects the window anyway).
    """
    rows = step.window_rows(max(window, 1))
    summed = rows.sum(dim=2)
    first_window_position = step.query_positions[-rows.shape[2]]
    in_window = (step.view.positions >= first_window_position).repeat_interleave(step.groups, dim=1)
    summed = summed.masked_fill(in_window, 0.0)
    pooled = pool_scores(summed, kernel_size, pooling)
    return reduce_groups(pooled, step.kv_heads, reduce)
