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

#: What one more strided run costs a decoding step, in slots, on a CPU: a run is attended in place (no gather), so
#: a slot costs only its attention and a call weighs more than in :data:`CALL_COST`'s gathered groups. Measured
#: (default model's shapes, batch 8, 3 KV heads of 64, 2 threads): one more call ≈ 2,900 slots' attention in
#: bf16, ≈ 850 in float32; between them.
RUN_CALL_COST = 1024


#: On a CPU, a layout cut into strided runs whose layer holds at most this many segments (batch 1 of a model with
#: up to 4 KV heads) is attended in one masked call over its whole buffer rather than one call per run: every query
#: row scans every row, each masked to its own segment's held entries (``StoreLayout.one_call_mask``). The redundant
#: dot products cost less than the calls they save while the segments are this few. Measured inside the default
#: model's decoding step (bf16, 3 KV heads of 64, 2 threads, KVzip's global budget: one head of 160–3,500 entries
#: beside heads of about 5): 225–440 µs per such layer in 2–3 runs, 195–390 in one call.
ONE_CALL_SEGMENTS = 4


def attends_in_one_call(segments: int, device: torch.device) -> bool:
    """Whether strided runs of ``segments`` segments on ``device`` are attended in one masked call
    (:data:`ONE_CALL_SEGMENTS`; elsewhere than a CPU, not measured: one call per run)."""
    return device.type == "cpu" and segments <= ONE_CALL_SEGMENTS


def run_call_cost(device: torch.device) -> int:
    """Slots one more strided run is worth on ``device`` (elsewhere than a CPU: :data:`ACCELERATOR_CALL_COST`)."""
    return RUN_CALL_COST if device.type == "cpu" else ACCELERATOR_CALL_COST


#: What a compact layout's decoding step pays per slot of the padded view it gathers, beyond attending it, in slots
#: (a CPU): the copy of the slot (its key and value rows) ≈ half its attention; the gather's own operations (two
#: ``index_select`` and the boolean mask SDPA converts) weigh about one more call. Measured with AdaKV at 256 on the
#: default model (4k, bf16, 2 threads), a layer whose heads were too uneven to pad under the cap and even enough for
#: one padded view: the compact layout's step 751 µs per layer at batch 8 (24 heads of 210–330 entries) and 385 at
#: batch 1, against ~660 and ~340 in two or three strided runs.
GATHER_SLOT_COST = 0.5


def compact_step_cost(segments: int, longest: int, device: torch.device) -> float | None:
    """A compact layout's decoding step in slots — its padded view gathered (:data:`GATHER_SLOT_COST` per slot and
    one call's worth for the gather) and attended in one call — comparable with strided runs' slots plus
    :func:`run_call_cost` per run; None elsewhere than a CPU (not measured there: the layout stays compact)."""
    if device.type != "cpu":
        return None
    cost = run_call_cost(device)
    return segments * longest * (1 + GATHER_SLOT_COST) + 2 * cost


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
    #: A strided run's first buffer row (its segments back to back, ``stride`` rows each: the buffers viewed
    #: ``(members, stride, ...)`` with no gather; see ``StoreCompaction.plan_runs``); None for a group that is gathered.
    base: int | None = None
    stride: int = 0


@dataclass(frozen=True)
class RunViews:
    """A layout's strided runs as a decoding step reads them, built once per layout and buffers
    (:meth:`~kvsieve.cache.store_layout.StoreLayout.run_views`): every segment's rows in run order and back.

    Attributes:
        order: the segments in run order (a device index; None when run order is segment order).
        inverse: where each segment lies in run order (None likewise).
        sizes: segments per run, in run order (``torch.split`` sizes).
        keys, values: per run, the buffers viewed ``(members, 1, stride, d)`` (zero-copy).
        bias: per run, the rows' validity as an additive mask (``StoreLayout.row_bias``) viewed
            ``(members, 1, 1, stride)``; None where every member holds as many entries (no mask).
    """

    order: torch.Tensor | None
    inverse: torch.Tensor | None
    sizes: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    bias: tuple[torch.Tensor | None, ...]


Run = tuple[torch.Tensor, int, bool]


def partitions(lengths: torch.Tensor) -> dict[int, tuple[int, list[Run]]]:
    """For each number of runs ``g`` ≤ :data:`MAX_GROUPS` (and ≤ the segments), the cut of the segments sorted by
    ``lengths`` (host ``long`` ``(segments,)``) into ``g`` runs holding the fewest padded slots (a run pads every
    segment to its longest): ``{g: (slots, [(segments, longest, equal), ...])}``. One dynamic programme over the
    sorted lengths, each of its ``g`` rounds one ``(segments + 1)²`` tensor operation (a batch of 64 with 8 KV heads
    plans in milliseconds). Up to :data:`SMALL_PARTITION` segments the same programme runs on Python ints (a batch-1
    layer: one compaction of DBTrimKV's global budget plans 30 layers twice each; ~30 tensor operations per plan
    cost more than the arithmetic), with the same result, ties included."""
    return _small_partitions(lengths) if lengths.numel() <= SMALL_PARTITION else _tensor_partitions(lengths)


def _tensor_partitions(lengths: torch.Tensor) -> dict[int, tuple[int, list[Run]]]:
    """:func:`partitions` as tensor operations, each round one ``(segments + 1)²`` operation."""
    count = lengths.numel()
    order = torch.argsort(lengths, stable=True)
    ordered = lengths[order].to(torch.float64)
    # best[i]: fewest slots of the first i sorted segments in the runs so far; a run (j, i] pads to ordered[i - 1]
    ends = torch.arange(1, count + 1, dtype=torch.float64)
    begins = torch.arange(0, count + 1, dtype=torch.float64)
    run_slots = (ends[None, :] - begins[:, None]) * ordered[None, :]  # [j, i - 1]: run (j, i]
    run_slots = run_slots.masked_fill(begins[:, None] >= ends[None, :], float("inf"))
    best = torch.full((count + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    cuts: list[torch.Tensor] = []
    out: dict[int, tuple[int, list[Run]]] = {}
    for g in range(1, min(MAX_GROUPS, count) + 1):
        totals = best[:, None] + run_slots  # [j, i - 1]
        values, cut = totals.min(dim=0)  # first j on ties, as a left-to-right scan keeps
        best = torch.cat([torch.full((1,), float("inf"), dtype=torch.float64), values])
        cuts.append(cut)
        runs: list[Run] = []
        end = count
        for round_cuts in reversed(cuts):
            begin = int(round_cuts[end - 1])
            members = order[begin:end]
            runs.append((members, int(lengths[order[end - 1]]), int(ordered[begin]) == int(ordered[end - 1])))
            end = begin
        out[g] = (int(best[count]), runs[::-1])
    return out


#: Segments up to which :func:`partitions` runs its programme on Python ints rather than tensors (measured: 43 vs
#: 195 µs at 3 segments, 141 vs 214 at 32; even near 44).
SMALL_PARTITION = 32


def _small_partitions(lengths: torch.Tensor) -> dict[int, tuple[int, list[Run]]]:
    """:func:`partitions` on Python ints: the same cuts (the first ``j`` on ties, as ``min`` along a dimension
    returns it) and the same runs, members as views of the same stable sort."""
    values = lengths.tolist()
    count = len(values)
    order_list = sorted(range(count), key=values.__getitem__)  # stable, as ``argsort(stable=True)``
    order = torch.tensor(order_list, dtype=torch.long)
    ordered = [values[i] for i in order_list]
    infinite = float("inf")
    best: list[float] = [0.0] + [infinite] * count
    cuts: list[list[int]] = []
    out: dict[int, tuple[int, list[Run]]] = {}
    for g in range(1, min(MAX_GROUPS, count) + 1):
        round_best, round_cut = [infinite], []
        for end in range(1, count + 1):  # run (begin, end] pads to ordered[end - 1]
            longest, least, where = ordered[end - 1], infinite, 0
            for begin in range(end):
                total = best[begin] + (end - begin) * longest
                if total < least:
                    least, where = total, begin
            round_best.append(least)
            round_cut.append(where)
        best = round_best
        cuts.append(round_cut)
        runs: list[Run] = []
        end = count
        for each in reversed(cuts):
            begin = each[end - 1]
            runs.append((order[begin:end], values[order_list[end - 1]], ordered[begin] == ordered[end - 1]))
            end = begin
        out[g] = (int(best[count]), runs[::-1])
    return out


def plan_groups(lengths: torch.Tensor, cost: int | None = None,
                cuts: dict[int, tuple[int, list[Run]]] | None = None) -> list[Run] | None:
    """Cut segments sorted by ``lengths`` (host ``long`` ``(segments,)``) into ≤ :data:`MAX_GROUPS` runs that
    minimise padded slots + ``cost`` per run (default: a CPU's :data:`CALL_COST`); None when one padded view is as
    good (saves less than :data:`MIN_SAVING` of its slots). Returns ``(segments, longest, equal)`` per run.
    ``cuts``: :func:`partitions` of ``lengths`` when the caller made them already."""
    cost = CALL_COST if cost is None else cost
    count = lengths.numel()
    if count < 2:
        return None
    cuts = partitions(lengths) if cuts is None else cuts
    groups = min(cuts, key=lambda g: cuts[g][0] + g * cost)
    slots, runs = cuts[groups]
    if groups == 1 or slots > (1 - MIN_SAVING) * count * int(lengths.max()):
        return None
    return runs
