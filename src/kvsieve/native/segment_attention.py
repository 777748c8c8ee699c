"""A decoding query's attention over a ragged layer store read in place, on the CPU (``tiers.c``:
``kvsieve_attend_segments``).

A ragged layout (heads holding different numbers of entries: AdaKV's and CAKE's allocations, a global budget's
long and short heads, DuoAttention's whole retrieval heads beside streaming ones) keeps each segment's entries as
consecutive rows of the layer's buffers (:mod:`kvsieve.cache.store_layout`). PyTorch has no variable-length
attention call on the CPU, so the PyTorch path attends such a layer by length group, strided run or padded view —
one to three SDPA calls per layer and step, each over padding or a gathered copy, a long head read by one thread.
This pass reads every segment's rows where they lie, in one call: each segment is cut into units of at most
:data:`CHUNK` entries shared among torch's OpenMP threads, each unit's float32 softmax state (``m``, ``l``, ``acc``)
is computed as :mod:`kvsieve.native.tiered_attention` computes a part's, and a segment's units are folded in order.
The output is the attention of each query head over its KV head's held entries, as SDPA gives it, within float32
rounding (the order of the sums, a polynomial ``exp``), rounded to the query's dtype once.

:func:`attend` returns None for anything it does not take (off the CPU, a head size not a multiple of 8 or above 256,
more than 16 query heads per KV head, a CPU without AVX2/FMA/F16C, no built library, buffers not contiguous or in
another dtype, an empty segment): the caller then takes its PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch

from kvsieve.native import build
from kvsieve.native.build import F32, I32, I64, PTR
from kvsieve.native.dequantize import OUT_KINDS

#: Most entries one unit of work attends (a segment holding more is cut into several, folded in order). Measured in
#: the default model's decoding step (bf16, 3 KV heads of 64, 2 threads, DuoAttention at 4k, batch 1): 512 → 1.009×
#: a ``snapkv`` step holding as many entries, 2,048 → 1.023 (a long head's units balance the threads less well).
CHUNK = 512
#: Entries of a call from which its units are shared among torch's OpenMP threads (below: one thread). At 4,096, a
#: batch-8 layer of 3,072 entries ran on one thread: 137 µs against SDPA's 84 (timed alone).
PARALLEL_FROM = 1024

#: The argument types of ``kvsieve_attend_segments`` (``tiers.c``).
ARGUMENTS = (I32, I32, I32, I32, PTR, I32, I64, I64, PTR, F32, PTR, PTR, I32, PTR, PTR, I64, I64, I64)


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return build.function("tiers", "kvsieve_attend_segments", ARGUMENTS)


def attend(query: torch.Tensor, scaling: float, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor,
           length: torch.Tensor, extra: int = 0, chunk: int = CHUNK,
           parallel_from: int = PARALLEL_FROM) -> torch.Tensor | None:
    """Softmax attention of ``query`` ``(batch, q_heads, 1, d)`` over each KV head's entries: segment
    ``s = b · kv_heads + h`` holds ``length[s] + extra`` entries at rows ``start[s], …`` of ``keys``/``values``
    ``(rows, d)`` (contiguous; ``start``/``length`` host ``int64`` tensors of ``batch · kv_heads``). Returns
    ``(batch, 1, q_heads, d)`` in the query's dtype, or None where the pass does not apply (module docstring)."""
    batch, q_heads, q_len, dim = query.shape
    segments = start.numel()
    kv_heads = segments // batch if batch else 0
    rows = q_heads // kv_heads if kv_heads else 0
    kind, query_kind = OUT_KINDS.get(keys.dtype), OUT_KINDS.get(query.dtype)
    if (query.device.type != "cpu" or keys.device.type != "cpu" or q_len != 1 or kind is None or query_kind is None
            or dim % 8 or dim > 256 or rows < 1 or rows > 16 or rows * kv_heads != q_heads
            or kv_heads * batch != segments or query.stride(3) != 1 or values.dtype != keys.dtype
            or keys.dim() != 2 or keys.shape[1] != dim or values.shape != keys.shape
            or not keys.is_contiguous() or not values.is_contiguous() or length.numel() != segments
            or start.dtype != torch.int64 or length.dtype != torch.int64 or start.device.type != "cpu"
            or length.device.type != "cpu" or not start.is_contiguous() or not length.is_contiguous()):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    out = torch.empty((batch, 1, q_heads, dim), dtype=query.dtype)
    status = kernel(batch, kv_heads, rows, dim, query.data_ptr(), query_kind, query.stride(0), query.stride(1),
                    out.data_ptr(), scaling, keys.data_ptr(), values.data_ptr(), kind, start.data_ptr(),
                    length.data_ptr(), extra, chunk, parallel_from)
    return out if status == 0 else None
