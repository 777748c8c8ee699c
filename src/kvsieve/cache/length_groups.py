"""Length groups of a ragged store's segments, so a decoding step attends over each head's own entries.

The padded dense view of a ragged layer has ``segments × L_max`` slots: when one head holds far more than
the others (DuoAttention's retrieval heads, a global budget's long heads) most of what a decoding step
gathers and attends over is padding. Sorting the segments by length and cutting them into at most
:data:`MAX_GROUPS` runs, each padded only to its own longest segment, bounds the padding; a cut costs one
more attention call, counted as :data:`CALL_COST` slots. The plan is made on the host from the layout's
host lengths (no device work) and is kept while every segment only grows by one per decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: At most this many groups (attention calls) per layer and decoding step.
MAX_GROUPS = 3
#: What one more attention call costs, in padded slots (per-call overhead next to reading the entries).
CALL_COST = 2048
#: Group only when the grouped plan saves at least this fraction of the padded view's slots.
MIN_SAVING = 0.25


@dataclass(frozen=True)
class LengthGroup:
    """Segments (flat ``b · heads + h`` indices, host and entries' device) and their longest at plan time."""

    segments: torch.Tensor
    device_segments: torch.Tensor
    longest: int
    #: Whether every segment of the group has the same length (no padding, so no mask).
    equal: bool


def plan_groups(lengths: torch.Tensor) -> list[tuple[torch.Tensor, int, bool]] | None:
    """Cut segments sorted by ``lengths`` (host ``long`` ``(segments,)``) into ≤ :data:`MAX_GROUPS` runs that
    minimise padded slots + :data:`CALL_COST` per run; None when one padded view is as good (saves less than
    :data:`MIN_SAVING` of its slots). Returns ``(segments, longest, equal)`` per run."""
    count = lengths.numel()
    if count < 2:
        return None
    order = torch.argsort(lengths, stable=True)
    ordered = lengths[order].tolist()
    single = count * ordered[-1]
    # best[g][i]: least cost of the first i segments in g runs (a run ending at i - 1 pads to ordered[i - 1])
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(MAX_GROUPS + 1)]
    cut = [[0] * (count + 1) for _ in range(MAX_GROUPS + 1)]
    best[0][0] = 0.0
    for g in range(1, MAX_GROUPS + 1):
        for i in range(1, count + 1):
            for j in range(g - 1, i):
                cost = best[g - 1][j] + (i - j) * ordered[i - 1] + CALL_COST
                if cost < best[g][i]:
                    best[g][i], cut[g][i] = cost, j
    groups = min(range(1, MAX_GROUPS + 1), key=lambda g: best[g][count])
    grouped_slots = best[groups][count] - groups * CALL_COST
    if groups == 1 or grouped_slots > (1 - MIN_SAVING) * single:
        return None
    runs = []
    end = count
    for g in range(groups, 0, -1):
        begin = cut[g][end]
        members = order[begin:end]
        runs.append((members, ordered[end - 1], ordered[begin] == ordered[end - 1]))
        end = begin
    return runs[::-1]
