"""Length groups of a ragged store's segments, so a decoding step attends over each head's own entries.

The padded dense view of a ragged layer has ``segments × L_max`` slots: when one head holds far more than
the others (DuoAttention's retrieval heads, a global budget's long heads) most of what a decoding step
gathers and attends over is padding. Sorting the segments by length and cutting them into at most
:data:`MAX_GROUPS` runs, each padded only to its own longest segment, bounds the padding; a cut costs one
more attention call, counted as :func:`call_cost` slots. The plan is made on the host from the layout's
host lengths (no device work) and is kept while every segment only grows by one per decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: At most this many groups (attention calls) per layer and decoding step.
MAX_GROUPS = 3
#: What one more attention call costs, in padded slots, on a CPU: measured with the default model's shapes
#: (bf16, 3 KV heads of 64, 2 threads): one head of 200 entries and two of 40 break even, 400 and up group
#: faster (1.2× at 400, 1.9× at 1,600, 2.3× at 4,000 and batch 8 at 800).
CALL_COST = 256
#: The same on other devices, where an attention call is a few kernel launches and a slot a few hundred bytes of
#: fast memory: only very uneven heads group. Not calibrated (no GPU measurement yet): deliberately high.
ACCELERATOR_CALL_COST = 65536


#: A group whose every segment holds at least this many entries is attended segment by segment, each read in
#: place (no gather): copying a long head costs more than another attention call (CPU; measured at 4,096).
IN_PLACE_LENGTH = 512


def call_cost(device: torch.device) -> int:
    """Slots one more attention call is worth on ``device``."""
    return CALL_COST if device.type == "cpu" else ACCELERATOR_CALL_COST
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
    #: ``segments`` as Python ints (a decoding step loops over them without reading tensors).
    members: tuple[int, ...]


def plan_groups(lengths: torch.Tensor, cost: int | None = None) -> list[tuple[torch.Tensor, int, bool]] | None:
    """Cut segments sorted by ``lengths`` (host ``long`` ``(segments,)``) into ≤ :data:`MAX_GROUPS` runs that
    minimise padded slots + ``cost`` per run (default: a CPU's :data:`CALL_COST`); None when one padded view is as
    good (saves less than :data:`MIN_SAVING` of its slots). Returns ``(segments, longest, equal)`` per run."""
    cost = CALL_COST if cost is None else cost
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
                total = best[g - 1][j] + (i - j) * ordered[i - 1] + cost
                if total < best[g][i]:
                    best[g][i], cut[g][i] = total, j
    groups = min(range(1, MAX_GROUPS + 1), key=lambda g: best[g][count])
    grouped_slots = best[groups][count] - groups * cost
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
