"""Group-aware mixed-precision planning: which entries stay in the model dtype, which fill low-bit groups.

A quantized tier stores entries in KIVI groups of ``G`` tokens (keys are quantized per channel over the
group), and a group costs its full bytes until its last entry leaves. A plan that demotes entries one by
one at every compaction (decoding steps, blocks) would open a part-filled group each time and hold more
bytes than its budget. This plan counts bytes in groups instead, per head:

1. the ``full[s]`` best entries still in the model dtype stay there (the scorer's protected ones are among
   them: ``full`` covers them);
2. for each low tier in turn, its byte share buys ``groups[t][s]`` groups, and two kinds of unit compete for
   them by the mean score of their entries: the tier's **existing** groups (all their live entries; nothing
   is re-quantized) and **new** groups of ``G`` not-yet-quantized entries taken in score order (the last
   one may be partial: it still costs a group). The best units are kept; an existing group that loses is
   evicted whole, the entries of a new group that loses stay candidates for the next tier. With no existing
   group (a first compaction) this is exactly "the next entries in score order, in whole groups";
3. everything else is evicted.

So a head never holds more than ``full`` entries in the model dtype plus ``groups[t]`` groups per tier, at
every compaction, whatever the schedule. An entry already quantized is never moved to another tier.
"""

from __future__ import annotations

import math

import torch


def group_aware_plan(
    scores: torch.Tensor,
    origin: torch.Tensor,
    slot: torch.Tensor,
    full: torch.Tensor,
    groups: list[torch.Tensor],
    group: int,
    quantized: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept entries and their target tier, per segment.

    Args:
        scores: ``(S, L)`` scores over the (combined) view, ``-inf`` on padding slots.
        origin: ``(S, L)`` where each slot's entry lives (0: the model dtype; ``t ≥ 1``: tier ``t``).
        slot: ``(S, L)`` the entry's slot in its tier's own view (its group is ``slot // group``).
        full: ``(S,)`` entries to keep in the model dtype.
        groups: per low tier, ``(S,)`` groups it may hold.
        group: ``G``, entries per group.
        quantized: whether any tier holds entries (the caller knows from its bookkeeping). False (every
            ``origin`` is 0, as at a first compaction): step 2 has no existing group, its new groups are formed in
            score order and so are chosen in that order, and the plan is the score order cut at ``full``,
            ``full + G·groups[0]``, … — the same plan as the general path, from one ``topk`` (no sort, no group
            sums: :func:`_first_plan`).

    Returns ``keep`` ``(S, L)`` bool and ``target`` ``(S, L)`` long: for kept model-dtype entries the tier they
    go to (0: stay), for kept quantized entries their own tier.
    """
    segments, length = scores.shape
    device = scores.device
    values = scores.float()
    valid = ~torch.isneginf(values) & ~torch.isnan(values)
    is_full = valid & (origin == 0)
    neg = torch.tensor(-math.inf, device=device)
    zero = torch.zeros((), device=device)
    positions = torch.arange(length, device=device).expand(segments, -1)

    def ranks(masked: torch.Tensor) -> torch.Tensor:
        """Each slot's rank within its segment by descending ``masked`` score (ties: lower slot first)."""
        order = torch.argsort(masked, dim=1, descending=True, stable=True)
        return torch.empty_like(order).scatter_(1, order, positions)

    if not quantized:
        return _first_plan(is_full, torch.where(is_full, values, neg), full.to(device), groups, group)
    # 1. the best model-dtype entries stay
    stay = is_full & (ranks(torch.where(is_full, values, neg)) < full.to(device)[:, None])
    keep = stay.clone()
    target = torch.where(valid & (origin > 0), origin, torch.zeros_like(origin))
    candidate = is_full & ~stay
    chunks = max(-(-length // group), 1)  # most new groups a segment could form
    for tier, allowed in enumerate(groups, start=1):
        mine = valid & (origin == tier)
        # existing groups of this tier: summed scores of their live entries
        group_id = torch.where(mine, slot // group, torch.zeros_like(slot))
        width = int(group_id.max()) + 1 if bool(mine.any()) else 1
        existing = torch.zeros(segments, width, device=device).scatter_add(1, group_id, torch.where(mine, values, zero))
        present = torch.zeros(segments, width, dtype=torch.long, device=device).scatter_add(1, group_id, mine.long())
        # new groups: the candidates in score order, cut into groups of G (the last one may be partial)
        chunk = ranks(torch.where(candidate, values, neg)) // group
        formed = ((candidate.sum(dim=1) + group - 1) // group)[:, None]
        in_chunk = candidate
        chunk = chunk.clamp(max=chunks - 1)
        chunk_sum = torch.zeros(segments, chunks, device=device).scatter_add(1, chunk, torch.where(in_chunk, values,
                                                                                                  zero))
        chunk_size = torch.zeros(segments, chunks, dtype=torch.long, device=device).scatter_add(1, chunk,
                                                                                              in_chunk.long())
        chunk_ok = torch.arange(chunks, device=device)[None, :] < formed
        # the `allowed` units with the highest mean score (existing groups first on ties: stable sort, listed first)
        units = torch.cat([torch.where(present > 0, existing / present.clamp(min=1), neg),
                           torch.where(chunk_ok, chunk_sum / chunk_size.clamp(min=1), neg)], dim=1)
        order = torch.argsort(units, dim=1, descending=True, stable=True)
        unit_rank = torch.empty_like(order).scatter_(
            1, order, torch.arange(units.shape[1], device=device).expand(segments, -1))
        chosen = (unit_rank < allowed.to(device)[:, None]) & ~torch.isneginf(units)
        keep |= mine & torch.gather(chosen[:, :width], 1, group_id)
        demoted = in_chunk & torch.gather(chosen[:, width:], 1, chunk)
        keep |= demoted
        target = torch.where(demoted, torch.full_like(target, tier), target)
        candidate = candidate & ~demoted
    return keep, target


def _first_plan(is_full: torch.Tensor, masked: torch.Tensor, full: torch.Tensor, groups: list[torch.Tensor],
                group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`group_aware_plan` when no tier holds an entry. Its new groups of a tier are the candidates in score
    order cut into groups of ``G``, so their mean scores do not increase from one to the next and the stable
    choice of the best ``groups[t]`` takes the first ones: the candidates ranked ``edge … edge + G·groups[t] − 1``
    after the entries that stay (``edge`` starting at ``full``); the next tier continues from there. The ranks are
    never computed: each edge is a top-``k`` membership (:func:`_ranked_below`) from one ``topk``."""
    edges = [full]
    for allowed in groups:
        edges.append(edges[-1] + allowed.to(full.device) * group)
    most = min(int(edges[-1].max()) if edges[-1].numel() else 0, masked.shape[1])  # one host read per plan
    top = torch.topk(masked, most, dim=1, sorted=True).values if most else None
    inside = [_ranked_below(masked, top, edge) for edge in edges]
    keep = is_full & inside[0]
    target = torch.zeros(masked.shape, dtype=torch.long, device=masked.device)
    for tier in range(1, len(edges)):
        demoted = is_full & inside[tier] & ~inside[tier - 1]
        keep |= demoted
        target.masked_fill_(demoted, tier)
    return keep, target


def _ranked_below(masked: torch.Tensor, top: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor:
    """Whether each slot ranks below ``count[s]`` in its segment by descending ``masked``, equal values ranked by
    slot (the stable descending sort's ranks): the values above the ``count``-th largest (``top``, the sorted
    largest values), then the first of its equals as needed."""
    if top is None:
        return torch.zeros(masked.shape, dtype=torch.bool, device=masked.device)
    count = count.clamp(max=top.shape[1])[:, None]
    threshold = torch.gather(top, 1, (count - 1).clamp(min=0))
    above = masked > threshold
    equal = masked == threshold
    needed = count - above.sum(dim=1, keepdim=True)
    return (above | (equal & (torch.cumsum(equal, dim=1) <= needed))) & (count > 0)
