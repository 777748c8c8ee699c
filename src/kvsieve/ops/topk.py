"""Eviction: keep the ``counts[b, h]`` highest-scoring entries of each head, in position order."""

from __future__ import annotations

import torch


def top_entries(scores: torch.Tensor, counts: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Local indices ``(batch * kv_heads, K)`` of the kept entries, ascending within each row.

    ``scores`` is ``(batch, kv_heads, L)`` (``-inf`` on padding slots), ``counts`` ``(batch, kv_heads)``
    with ``counts ≤`` the valid entries of each head; ``K = max(counts)``. Entries past ``counts`` in a
    row are filler (``L``) and are ignored by :meth:`LayerStore.keep`. ``width``: ``K`` when the caller already
    read it (saves a device-to-host read).
    """
    batch, heads, length = scores.shape
    flat = scores.reshape(batch * heads, length)
    if width is None:
        width = int(counts.max()) if counts.numel() else 0
    top = torch.topk(flat, width, dim=-1, sorted=True).indices
    rank = torch.arange(width, device=scores.device)[None, :]
    top = top.masked_fill(rank >= counts.reshape(-1, 1).to(scores.device), length)
    return torch.sort(top, dim=-1).values
