"""GQA reduction: one selection per KV head from per-query-head scores (group-wise selection
as in RocketKV, Behnam et al., 2025, arXiv:2502.14051, Sec. 3.3, following Ada-KV, Feng et al. 2024,
arXiv:2407.11550)."""

from __future__ import annotations

import torch


def reduce_groups(scores: torch.Tensor, kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Reduce ``(batch, q_heads, n)`` scores over the query heads of each KV group to ``(batch, kv_heads, n)``.

    ``how`` is ``"mean"`` (SnapKV/AdaKV practice) or ``"sum"`` (RocketKV). Query head ``i`` belongs
    to KV head ``i // groups``, as in transformers' ``repeat_kv``.
    """
    batch, heads, n = scores.shape
    grouped = scores.view(batch, kv_heads, heads // kv_heads, n)
    if how == "mean":
        return grouped.mean(dim=2)
    if how == "sum":
        return grouped.sum(dim=2)
    if how == "max":
        return grouped.amax(dim=2)
    raise ValueError(f"how must be one of 'mean', 'sum', 'max'; got {how!r}")
