"""Head-wise adaptive allocation (AdaKV, Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by
Adaptive Budget Allocation", arXiv:2407.11550, Alg. 1 with the safeguard floor of Sec. 4.3).

Within one layer, the ``H·B`` entries of a batch item go to the globally highest scores over all its
heads, after each head is first guaranteed ``floor = α·B`` entries.
"""

from __future__ import annotations

import torch


def adaptive_counts(
    scores: torch.Tensor, total: torch.Tensor, floor: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Entries per head ``(batch, heads)``.

    Args:
        scores: ``(batch, heads, L)``, higher = keep, ``-inf`` on padding slots.
        total: ``(batch,)`` entries the layer may hold per batch item (``heads × budget``).
        floor: ``(batch,)`` or ``(batch, heads)`` minimum per head.
        lengths: ``(batch, heads)`` entries held now (counts never exceed them).
    """
    batch, heads, length = scores.shape
    floor = floor.view(batch, 1) if floor.dim() == 1 else floor
    base = torch.minimum(floor.expand(batch, heads), lengths)
    ordered = torch.sort(scores.float(), dim=-1, descending=True).values
    rank = torch.arange(length, device=scores.device).view(1, 1, -1)
    candidates = ordered.masked_fill(rank < base.unsqueeze(-1), float("-inf")).reshape(batch, heads * length)
    remaining = (total - base.sum(dim=1)).clamp(min=0)
    width = int(min(int(remaining.max()) if remaining.numel() else 0, heads * length))
    if width == 0:
        return base
    values, index = torch.topk(candidates, width, dim=-1)
    chosen = (torch.arange(width, device=scores.device)[None, :] < remaining[:, None]) & torch.isfinite(values)
    chosen = chosen | (values == float("inf"))
    chosen = chosen & (values > float("-inf"))
    extra = torch.zeros(batch, heads, dtype=torch.long, device=scores.device)
    extra.scatter_add_(1, index // length, chosen.long())
    return torch.minimum(base + extra, lengths)
