"""EMS's every-step decoding compaction in place, on the CPU (``merge.c``: ``kvsieve_merge_lowest``).

Under ``ems`` with ``schedule="decode"`` every decoding step of a layer observes the query's attention row into the
Global-Local score's side data, scores, picks each head's to-be-merged entry, finds its most redundant class centre on
raw keys, merges or evicts it and drops it: in PyTorch some three hundred small operations per layer and step (2.6× a
``snapkv`` step). This pass does it in one ``ctypes`` call, in place, for
:meth:`~kvsieve.cache.store_compaction.StoreCompaction.merge_lowest`. Its side data updates are the general step's
bit for bit, its scores too (both sides compute them in float64 and round once), its merged rows within float32
rounding (``merge.c`` says why), and its decisions
are the general step's: a redundancy decision too close for float32 is taken on the float64 redundancy, as the general
step takes it (:class:`~kvsieve.parts.actions.evict_merge.EvictThenMerge`); where the scores' lowest two, or the
float64 redundancies, lie within a margin far above their rounding it returns False after observing, and the general
step plans.

:func:`merge_lowest` returns None, with nothing changed, for anything it does not take (off the CPU, a dtype other
than float32 or bfloat16, a buffer that is not contiguous rows, more than 16 query heads per KV head, a position past
the rotary table, no built library).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvsieve.native import build
from kvsieve.native.build import F32, F64, I32, I64, PTR
from kvsieve.native.evict_lowest import MOST_GROUPS

#: The argument types of ``kvsieve_merge_lowest`` (``merge.c``).
ARGUMENTS = (I64, I64, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, I64, I64, I64, I32, I32, F64, PTR, PTR, I32,
             I64, PTR, PTR, PTR, PTR, PTR, I64, I64, F32, F32, I32, PTR, PTR, PTR, PTR, PTR, PTR)
#: What the C function returns: done (no segment merged), a decision within its margin (observed, nothing else
#: changed), done with a merge.
DONE, UNDECIDED, DONE_MERGED = 0, 1, 2
KINDS = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class GlobalLocalStep:
    """EMS's parameters for the pass: the Global-Local score's ``window`` and pooling ``kernel`` and ``use_global``
    (:class:`~kvsieve.parts.scorers.global_local.GlobalLocal`), whether the plan merges (``⌊(γ − 1)·B⌋ ≥ 1``) and
    ``tau`` (:class:`~kvsieve.parts.actions.evict_merge.EvictThenMerge`)."""

    window: int
    kernel: int
    use_global: bool
    merges: bool
    tau: float


@dataclass(frozen=True)
class RotaryCosSin:
    """A layer's rotary ``cos`` and ``sin`` ``(positions, rotary_dim / 2)`` float32 (unscaled), ``cos64`` and
    ``sin64`` the same in float64 of the same float32 angles (:func:`~kvsieve.ops.rope.half_cos_sin64`: the exact
    redundancy's), its attention factor ``scaling``; ``half`` 0 for a layer without rotary dims."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos64: torch.Tensor
    sin64: torch.Tensor
    scaling: float

    @property
    def unrotate_factor(self) -> float:
        """``1 / scaling`` as :func:`~kvsieve.ops.rope.unrotate` multiplies by it (a Python float, taken to float32
        by the product)."""
        return 1.0 / self.scaling

    @property
    def half(self) -> int:
        return self.cos.shape[1]

    def __post_init__(self) -> None:
        dtypes = (torch.float32, torch.float32, torch.float64, torch.float64)
        if any(t.dtype != dtype or t.shape != self.cos.shape or t.device.type != "cpu" or not t.is_contiguous()
               for t, dtype in zip(self.tables(), dtypes, strict=True)) or self.cos.dim() != 2:
            raise ValueError("RotaryCosSin: cos, sin (float32) and cos64, sin64 (float64) must be contiguous CPU "
                             "tables of one shape (positions, rotary_dim / 2)")

    def tables(self) -> tuple[torch.Tensor, ...]:
        return self.cos, self.sin, self.cos64, self.sin64


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return build.function("merge", "kvsieve_merge_lowest", ARGUMENTS)


def available() -> bool:
    """Whether the pass is built (checked before a caller changes anything it would undo)."""
    return _kernel() is not None


@dataclass(frozen=True)
class MergeBuffers:
    """One uniform store's buffers as the pass takes them, checked once (:func:`prepare`) and kept by the store while
    its buffers stay (issue 22: the checks, the pointer arrays and the outputs' allocations were ~25 µs of each
    layer's call). ``tensors``: the side data, the counts, keys, values, positions and every buffer the drop moves,
    compared by identity (:meth:`holds`); ``dropped``, ``target``, ``weights`` and ``scratch`` the call's outputs and
    scratch, rewritten by every call."""

    tensors: tuple[torch.Tensor, ...]
    segments: int
    capacity: int
    kind: int
    dim: int
    pointers: ctypes.Array  # type: ignore[type-arg]
    row_bytes: ctypes.Array  # type: ignore[type-arg]
    dropped: torch.Tensor
    target: torch.Tensor
    weights: torch.Tensor
    scratch: torch.Tensor

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` (:func:`prepare`'s order) are the very tensors checked."""
        return len(tensors) == len(self.tensors) and all(a is b for a, b in zip(tensors, self.tensors, strict=True))


def prepare(segments: int, sides: Sequence[torch.Tensor], counts: torch.Tensor, capacity: int, keys: torch.Tensor,
            values: torch.Tensor, positions: torch.Tensor, buffers: Sequence[torch.Tensor]) -> MergeBuffers | None:
    """The pass's view of a uniform store of ``segments`` segments of ``capacity`` rows (:func:`merge_lowest`'s
    arguments), or None, where it does not take them: ``sides`` the score's side data (s_glo, s_loc's past and
    current parts, the current part's row count) and ``counts`` the merge counts, float32; ``keys``/``values``
    ``(rows, d)`` float32 or bfloat16 and ``positions`` int64; ``buffers`` every buffer the drop moves (all of them);
    every one contiguous rows on the CPU."""
    kind = KINDS.get(keys.dtype)
    float_buffers = (*sides, counts)
    if (kind is None or values.dtype != keys.dtype or len(sides) != 4 or positions.dtype != torch.long
            or segments < 1 or capacity < 2
            or any(t.dtype != torch.float32 or t.numel() != segments * capacity for t in float_buffers)
            or any(t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] != segments * capacity
                   for t in (keys, values, positions, *float_buffers, *buffers))):
        return None
    pointers = (ctypes.c_void_p * len(buffers))(*(t.data_ptr() for t in buffers))
    row_bytes = (ctypes.c_int64 * len(buffers))(*(math.prod(t.shape[1:]) * t.element_size() for t in buffers))
    return MergeBuffers((*sides, counts, keys, values, positions, *buffers), segments, capacity, kind, keys.shape[1],
                        pointers, row_bytes, torch.empty(segments, dtype=torch.long),
                        torch.empty(segments, dtype=torch.long), torch.empty(2 * segments, dtype=torch.float32),
                        torch.empty(segments * 4 * capacity, dtype=torch.float32))


def merge_lowest(rows: torch.Tensor, kv_heads: int, prepared: MergeBuffers, candidates: int, ems: GlobalLocalStep,
                 rotary: RotaryCosSin) -> tuple[torch.Tensor, bool] | bool | None:
    """One EMS decoding compaction of every segment (module docstring) from ``rows`` ``(batch, q_heads, 1, L)`` (the
    query's float32 softmax rows over the ``L`` held entries, contiguous) over the buffers ``prepared`` checked. The
    newest ``L − candidates`` entries are protected.

    Returns ``(dropped, merged)`` when done: each segment's dropped entry (``prepared.dropped``, rewritten by the
    next call) and whether any segment merged; False when a decision lay within the margin (the side data were
    observed, nothing else changed); None, with nothing changed, where the pass does not apply."""
    batch, q_heads, _, length = rows.shape
    groups = q_heads // kv_heads if kv_heads else 0
    if (rows.device.type != "cpu" or rows.dtype != torch.float32 or not rows.is_contiguous()
            or not 1 <= groups <= MOST_GROUPS or groups * kv_heads != q_heads or batch * kv_heads != prepared.segments
            or not 1 <= candidates <= length or not 2 <= length <= prepared.capacity):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    glo, past, cur, held, counts, keys, values, positions = prepared.tensors[:8]
    status = kernel(batch, kv_heads, groups, length, prepared.capacity, rows.data_ptr(), glo.data_ptr(),
                    past.data_ptr(), cur.data_ptr(), held.data_ptr(), counts.data_ptr(), ems.window, ems.kernel,
                    candidates, int(ems.use_global), int(ems.merges), ems.tau, keys.data_ptr(), values.data_ptr(),
                    prepared.kind, prepared.dim, positions.data_ptr(), *(t.data_ptr() for t in rotary.tables()),
                    rotary.half, rotary.cos.shape[0], rotary.scaling, rotary.unrotate_factor,
                    len(prepared.pointers), prepared.pointers, prepared.row_bytes, prepared.scratch.data_ptr(),
                    prepared.dropped.data_ptr(), prepared.target.data_ptr(), prepared.weights.data_ptr())
    if status in (DONE, DONE_MERGED):
        return prepared.dropped, status == DONE_MERGED
    if status == UNDECIDED:
        return False
    return None
