"""Every-step decoding eviction in place, on the CPU (``evict.c``: ``kvsieve_evict_lowest``).

A layer that drops one entry per head at every decoding step (``h2o`` or ``tova`` with ``schedule="decode"``) scores
from the new query's attention row, plans the entry with the lowest score and moves every buffer past it: in PyTorch
about twenty small operations per layer and step (H2O's group mean and its addition, the minimum and its uniqueness
check, a gather of each buffer into new ones). This pass does it in one ``ctypes`` call, in place, bit for bit as the
PyTorch path (``evict.c`` says how), for :meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_lowest`:
:func:`accumulate_and_evict` adds the rows' group means to an accumulated score first (H2O), :func:`evict_lowest`
takes scores computed by the caller (TOVA's).

Both return None for anything they do not take (off the CPU, a buffer that is not contiguous rows, more than 16 query
heads per KV head, heads that should hold the same positions and do not, no built library): the caller then takes
its PyTorch path, with nothing changed.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from kvsieve.native import build
from kvsieve.native.build import I32, I64, PTR

#: The argument types of ``kvsieve_evict_lowest`` (``evict.c``).
ARGUMENTS = (I64, I64, I64, I64, PTR, PTR, I64, I64, I64, I64, PTR, I32, PTR, PTR, PTR)
#: What the C function returns: dropped, a tie (or NaN) among the lowest scores.
DROPPED, TIED = 0, 1
#: The most query heads per KV head whose mean the pass sums in head order as torch does (torch's CPU sum is
#: sequential up to 16 terms, then cascades: ``aten/src/ATen/native/cpu/SumKernel.cpp``, ``multi_row_sum``).
MOST_GROUPS = 16


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return build.function("evict", "kvsieve_evict_lowest", ARGUMENTS)


def available() -> bool:
    """Whether the pass is built (checked before a caller changes anything it would undo)."""
    return _kernel() is not None


def accumulate_and_evict(rows: torch.Tensor, kv_heads: int, accumulator: torch.Tensor, capacity: int,
                         candidates: int, buffers: Sequence[torch.Tensor]) -> torch.Tensor | bool | None:
    """Add each KV head's group mean of ``rows`` ``(batch, q_heads, 1, L)`` (float32, contiguous: a decoding query's
    softmax rows over the ``L`` held entries of each segment) to ``accumulator`` (float32, ``capacity`` rows per
    segment), then drop each segment's entry with the lowest sum among its first ``candidates`` by moving the rows
    after it in every buffer of ``buffers`` (contiguous, ``capacity`` rows per segment; the accumulator among them).
    Returns the dropped local index per segment ``(batch · kv_heads,)``; False when some segment's lowest sum is tied
    or NaN (the sums were added, nothing moved); None, with nothing changed, where the pass does not apply."""
    batch, q_heads, _, length = rows.shape
    groups = q_heads // kv_heads if kv_heads else 0
    if (rows.device.type != "cpu" or rows.dtype != torch.float32 or not rows.is_contiguous()
            or not 1 <= groups <= MOST_GROUPS or groups * kv_heads != q_heads
            or accumulator.dtype != torch.float32 or accumulator.numel() != batch * kv_heads * capacity
            or not accumulator.is_contiguous()):
        return None
    return _evict(batch, kv_heads, groups, length, rows, accumulator, kv_heads * capacity, capacity, capacity,
                  candidates, None, buffers)


def evict_lowest(scores: torch.Tensor, kv_heads: int, capacity: int, candidates: int,
                 buffers: Sequence[torch.Tensor], positions: torch.Tensor | None = None) -> torch.Tensor | bool | None:
    """Drop each segment's entry with the lowest of ``scores`` ``(batch, kv_heads or 1, L)`` (float32, unit stride
    over ``L``; one row per batch item: shared by its KV heads) among its first ``candidates``, as
    :func:`accumulate_and_evict` does. Shared scores need each batch item's heads to hold the same positions: with
    ``positions`` (the store's buffer, ``capacity`` rows per segment) the pass checks that first. Returns as
    :func:`accumulate_and_evict` (None also for heads that are not aligned)."""
    batch, heads, length = scores.shape
    if (scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.stride(2) != 1
            or heads not in (1, kv_heads) or (positions is not None and (
                positions.dtype != torch.long or not positions.is_contiguous()
                or positions.numel() != batch * kv_heads * capacity))):
        return None
    head_stride = scores.stride(1) if heads > 1 else 0
    return _evict(batch, kv_heads, 1, length, None, scores, scores.stride(0), head_stride, capacity, candidates,
                  positions, buffers)


def _evict(batch: int, kv_heads: int, groups: int, length: int, rows: torch.Tensor | None, scores: torch.Tensor,
           score_batch: int, score_head: int, capacity: int, candidates: int, positions: torch.Tensor | None,
           buffers: Sequence[torch.Tensor]) -> torch.Tensor | bool | None:
    segments = batch * kv_heads
    if (not 1 <= candidates <= length or capacity < length
            or any(t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] != segments * capacity
                   for t in buffers)):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    dropped = torch.empty(segments, dtype=torch.long)
    pointers = (ctypes.c_void_p * len(buffers))(*(t.data_ptr() for t in buffers))
    row_bytes = (ctypes.c_int64 * len(buffers))(*(math.prod(t.shape[1:]) * t.element_size() for t in buffers))
    status = kernel(batch, kv_heads, groups, length, None if rows is None else rows.data_ptr(), scores.data_ptr(),
                    score_batch, score_head, capacity, candidates, None if positions is None else positions.data_ptr(),
                    len(buffers), pointers, row_bytes, dropped.data_ptr())
    if status == DROPPED:
        return dropped
    if status == TIED:
        return False
    return None
