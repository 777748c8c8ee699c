"""A decoding query's attention over a tiered store read in place, on the CPU (``tiers.c``: ``kvsieve_attend_*``).

The PyTorch path of a mixed-precision decoding step dequantizes every tier into a view that also holds a copy of
the full-precision entries, then runs SDPA over it: per layer and step it writes and reads back every held entry
in the model dtype. This pass reads the packed codes and the full-precision buffers where they are and folds each
part into one float32 softmax state per query row (``m``, ``l``, ``acc``; ``tiers.c`` describes it), so nothing is
materialised. The keys and values it attends are exactly the dequantized ones; the output differs from SDPA's by
float32 rounding only (the order of the sums, its polynomial ``exp``), and it is rounded to the query's dtype once.

:func:`attend` returns None for anything it does not take (off the CPU, a head size not a multiple of 8 or above
256, more than 16 query heads per KV head, a CPU without AVX2/FMA/F16C, no built library): the caller then takes
its PyTorch path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvsieve.native import build
from kvsieve.native.dequantize import OUT_KINDS

_functions: tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None = None  # type: ignore[name-defined]
_loaded = False


@dataclass(frozen=True)
class PackedTier:
    """One tier's buffers and slot layout as :meth:`~kvsieve.cache.quantized_tier.QuantizedTier.attention_layout`
    gives it: ``index`` the groups in layout order (None: all, in order), ``valid`` ``(batch, heads, slots)`` bool
    (None: every slot holds an entry), ``slots`` per segment."""

    bits: int
    group: int
    value_group: int
    key_codes: torch.Tensor
    key_params: torch.Tensor
    value_codes: torch.Tensor
    value_params: torch.Tensor
    index: torch.Tensor | None
    valid: torch.Tensor | None
    slots: int


def _kernels() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    global _functions, _loaded
    if not _loaded:
        library = build.load("tiers")
        if library is not None:
            i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
            dense, tier = library.kvsieve_attend_dense, library.kvsieve_attend_tier
            dense.argtypes = [i32, i32, i32, i32, ptr, f32, ptr, ptr, i32, i64, i64, i64, i64, ptr, ptr, ptr, ptr]
            tier.argtypes = [i32, i32, i32, i32, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, ptr, f32, ptr, ptr,
                             ptr]
            dense.restype = tier.restype = i32
            _functions = (dense, tier)
        _loaded = True
    return _functions


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def attend(query: torch.Tensor, scaling: float, keys: torch.Tensor, values: torch.Tensor,
           valid: torch.Tensor | None, tiers: list[PackedTier]) -> torch.Tensor | None:
    """Softmax attention of ``query`` ``(batch, q_heads, 1, d)`` over the full-precision entries ``keys``/``values``
    ``(batch, kv_heads, L, d)`` (any strides but a unit stride over ``d``; ``valid`` ``(batch, kv_heads, L)`` bool or
    None) and every tier's entries: ``(batch, 1, q_heads, d)`` in the query's dtype, or None where the pass does not
    apply (module docstring)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = keys.shape[1]
    rows = q_heads // kv_heads if kv_heads else 0
    kind = OUT_KINDS.get(keys.dtype)
    if (query.device.type != "cpu" or keys.device.type != "cpu" or q_len != 1 or kind is None or dim % 8 or dim > 256
            or rows < 1 or rows > 16 or rows * kv_heads != q_heads or values.dtype != keys.dtype
            or values.shape != keys.shape or values.stride() != keys.stride() or keys.stride(3) != 1
            or (valid is not None and valid.dtype != torch.bool)):
        return None
    for tier in tiers:
        if (tier.key_codes.device.type != "cpu" or tier.value_group % 8 or tier.slots % tier.group
                or tier.key_params.dtype != torch.float16 or tier.value_params.dtype != torch.float16
                or (tier.index is not None and tier.index.dtype != torch.int64)
                or (tier.valid is not None and tier.valid.dtype != torch.bool)):
            return None
    kernels = _kernels()
    if kernels is None:
        return None
    dense, tier_kernel = kernels
    q = query.reshape(batch, q_heads, dim).float().contiguous()
    m = torch.full((batch * q_heads,), float("-inf"))
    l_sum = torch.zeros(batch * q_heads)
    acc = torch.zeros(batch * q_heads, dim)
    length = keys.shape[2]
    if length:
        ok = None if valid is None else valid.contiguous()
        if dense(batch, kv_heads, rows, dim, q.data_ptr(), scaling, keys.data_ptr(), values.data_ptr(), kind,
                 keys.stride(0), keys.stride(1), keys.stride(2), length, _pointer(ok), m.data_ptr(), l_sum.data_ptr(),
                 acc.data_ptr()):
            return None
    for tier in tiers:
        most = tier.slots // tier.group
        groups = batch * kv_heads * most
        index = None if tier.index is None else tier.index.contiguous()
        ok = None if tier.valid is None else tier.valid.contiguous()
        if groups and tier_kernel(tier.bits, tier.group, dim, tier.value_group, groups, most, _pointer(index),
                                  tier.key_codes.data_ptr(), tier.key_params.data_ptr(), tier.value_codes.data_ptr(),
                                  tier.value_params.data_ptr(), _pointer(ok), kv_heads, rows, q.data_ptr(), scaling,
                                  m.data_ptr(), l_sum.data_ptr(), acc.data_ptr()):
            return None
    out = acc.div_(l_sum[:, None]).to(query.dtype)
    return out.view(batch, 1, q_heads, dim)
