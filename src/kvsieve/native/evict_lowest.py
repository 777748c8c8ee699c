"""Every-step decoding eviction in place, on the CPU (``evict.c``: ``kvsieve_evict_lowest``).

A layer that drops one entry per head at every decoding step (``h2o`` with ``schedule="decode"``) observes the new
query's attention row, plans the entry with the lowest score and moves every buffer past it: in PyTorch about twenty
small operations per layer and step (the group mean and its addition, the minimum and its uniqueness check, a gather
of each buffer into new ones). This pass does all of it in one ``ctypes`` call, in place, bit for bit as the
PyTorch path (``evict.c`` says how), for :meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_lowest`.

:func:`evict_lowest` returns None for anything it does not take (off the CPU, a buffer that is not contiguous rows,
no built library): the caller then takes its PyTorch path, with nothing changed.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from kvsieve.native import build
from kvsieve.native.build import I32, I64, PTR

#: The argument types of ``kvsieve_evict_lowest`` (``evict.c``).
ARGUMENTS = (I64, I64, I64, I64, PTR, PTR, I64, I64, I32, PTR, PTR, PTR)
#: What the C function returns: dropped, a tie (or NaN) among the lowest scores, refused.
DROPPED, TIED = 0, 1


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return build.function("evict", "kvsieve_evict_lowest", ARGUMENTS)


def available() -> bool:
    """Whether the pass is built (checked before a caller changes anything it would undo)."""
    return _kernel() is not None


def evict_lowest(rows: torch.Tensor, kv_heads: int, accumulator: torch.Tensor, capacity: int, candidates: int,
                 buffers: Sequence[torch.Tensor]) -> torch.Tensor | bool | None:
    """Add each KV head's group mean of ``rows`` ``(batch, q_heads, 1, L)`` (float32, contiguous: a decoding query's
    softmax rows over the ``L`` held entries of each segment) to ``accumulator`` (float32, ``capacity`` rows per
    segment), then drop each segment's entry with the lowest accumulator among its first ``candidates`` by moving
    the rows after it in every buffer of ``buffers`` (contiguous, ``capacity`` rows per segment; the accumulator
    among them). Returns the dropped local index per segment ``(batch · kv_heads,)``; False when some segment's lowest
    score is tied or NaN (the accumulator was updated, nothing moved); None, with nothing changed, where the pass does
    not apply."""
    batch, q_heads, _, length = rows.shape
    groups = q_heads // kv_heads if kv_heads else 0
    segments = batch * kv_heads
    if (rows.device.type != "cpu" or rows.dtype != torch.float32 or not rows.is_contiguous() or groups < 1
            or groups * kv_heads != q_heads or not 1 <= candidates <= length or capacity < length
            or accumulator.dtype != torch.float32 or accumulator.numel() != segments * capacity
            or not accumulator.is_contiguous()
            or any(t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] != segments * capacity
                   for t in buffers)):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    dropped = torch.empty(segments, dtype=torch.long)
    pointers = (ctypes.c_void_p * len(buffers))(*(t.data_ptr() for t in buffers))
    row_bytes = (ctypes.c_int64 * len(buffers))(*(math.prod(t.shape[1:]) * t.element_size() for t in buffers))
    status = kernel(batch, kv_heads, groups, length, rows.data_ptr(), accumulator.data_ptr(), capacity, candidates,
                    len(buffers), pointers, row_bytes, dropped.data_ptr())
    if status == DROPPED:
        return dropped
    if status == TIED:
        return False
    return None
