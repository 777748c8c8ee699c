"""Head-wise adaptive allocation (AdaKV, Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by
Adaptive Budget Allocation", arXiv:2407.11550, Alg. 1 with the safeguard floor of Sec. 4.3).

Within one layer (or, for a global budget, one model), the entries of a batch row go to its globally
highest scores over all its heads, after each head is first guaranteed its floor and every entry its
scorer protects (``+inf``). Each batch row is decided on its own scores, lengths and total only: what a
row keeps never depends on the other rows of the batch (their lengths, padding or ties).
"""

from __future__ import annotations

import torch


def adaptive_counts(
    scores: torch.Tensor, total: torch.Tensor, floor: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Entries per head ``(batch, heads)``.

    Each head first gets ``base = min(max(floor, protected), length)`` entries, ``protected`` being its
    number of ``+inf`` scores (entries the scorer always keeps: they are never dropped, even when they
    exceed the row's total); the row's remaining ``total - Σ base`` entries (if any) then go to the
    highest other scores of all its heads. Ties are broken by head index, then by rank within the head,
    the same whatever the batch around the row. So a row keeps ``max(total, Σ base)`` entries, never more
    than it holds.

    Args:
        scores: ``(batch, heads, L)``, higher = keep, ``+inf`` always kept, ``-inf`` on padding slots.
        total: ``(batch,)`` entries the row may hold over all heads (``Σ`` of the nominal budgets).
        floor: ``(batch,)`` or ``(batch, heads)`` minimum per head.
        lengths: ``(batch, heads)`` entries held now (counts never exceed them).
    """
    batch, heads, length = scores.shape
    floor = floor.view(batch, 1) if floor.dim() == 1 else floor
    protected = torch.isposinf(scores).sum(dim=-1)
    base = torch.minimum(torch.maximum(floor.expand(batch, heads), protected), lengths)
    remaining = (total - base.sum(dim=1)).clamp(min=0)
    if length == 0 or not bool((remaining > 0).any()):
        return base
    ordered = torch.sort(scores.float(), dim=-1, descending=True).values
    rank = torch.arange(length, device=scores.device).view(1, 1, -1)
    candidates = ordered.masked_fill(rank < base.unsqueeze(-1), float("-inf"))  # each head past its base
    # The row's `take` highest candidates, equal scores going to the lower (head, rank) — what a stable sort of the
    # row's (head, rank)-ordered candidates would pick — found by value: the take-th highest candidate is the
    # threshold; every candidate above it is kept, and of those equal to it the first ones in head order. A top-k
    # of the batch's largest take only gives each row its own threshold (its take-th value): no sort of every entry.
    take = torch.minimum(remaining.to(scores.device), (candidates > float("-inf")).sum(dim=(1, 2)))
    most = int(take.max())
    if most == 0:
        return base
    top = torch.topk(candidates.reshape(batch, heads * length), most, dim=-1).values
    threshold = top.gather(1, (take - 1).clamp(min=0)[:, None]).masked_fill(take[:, None] == 0, float("inf"))
    threshold = threshold.view(batch, 1, 1)
    above = (candidates > threshold).sum(dim=-1)  # (batch, heads)
    ties = (candidates == threshold).sum(dim=-1)
    left = take[:, None] - above.sum(dim=1, keepdim=True)  # ties still to keep, by head order
    tied = torch.minimum((left - (ties.cumsum(dim=1) - ties)).clamp(min=0), ties)
    return torch.minimum(base + above + tied, lengths)
