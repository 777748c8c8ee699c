"""A precision tier's KIVI dequantization in one C pass (``tiers.c``), for decoding on the CPU.

The PyTorch path (:meth:`kvsieve.cache.quantized_tier.QuantizedTier.dequantized`) makes about ten tensor operations
per tier and layer at every decoding step — gathers of the packed groups, a code lookup and a multiply-add for
keys and for values, copies into the attention view — and at a decoding step's sizes each costs more in dispatch
than in arithmetic. The C pass reads the packed codes and their float16 steps and minimums once and writes the
rounded entries straight into the view: the same numbers bit for bit (``tiers.c`` says why), ~5× faster for a
2-bit tier of 960 entries (230 → 45 µs on an AMX Xeon). It runs on one thread (``tiers.c`` says why).

:func:`dequantize_into` returns False for anything it does not take (a tensor off the CPU, a dtype or layout it
does not read, no built library): the caller then runs its PyTorch path. On a GPU the PyTorch path's shifts and
masks are elementwise kernels, and this module is not used.
"""

from __future__ import annotations

import ctypes

import torch

from kvsieve.native import build
from kvsieve.native.build import I32, I64, PTR

#: View dtypes the C pass writes, by its ``out_kind`` code.
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Widest head the C pass takes (its row buffers).
MAX_DIM = 1024

#: The argument types of ``kvsieve_dequantize`` (``tiers.c``).
ARGUMENTS = (I32, I32, I32, I32, I64, I64, PTR, PTR, PTR, PTR, PTR, I32, PTR, PTR, I32, I64, I64,
             I64)


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return build.function("tiers", "kvsieve_dequantize", ARGUMENTS)


def available() -> bool:
    """Whether the C pass is built and loaded (builds it on the first call)."""
    return _kernel() is not None


def dequantize_into(bits: int, group: int, value_group: int, key_codes: torch.Tensor, key_params: torch.Tensor,
                    value_codes: torch.Tensor, value_params: torch.Tensor, groups: torch.Tensor | None,
                    keys_out: torch.Tensor, values_out: torch.Tensor) -> bool:
    """Dequantize a tier's groups into ``keys_out``/``values_out`` ``(batch, heads, slots, d)`` (any strides but a
    unit stride over ``d``; ``slots`` a multiple of ``group``); False, with nothing written, where the C pass does
    not apply.

    ``key_codes``/``value_codes`` ``(groups, G, width)`` uint8, ``key_params`` ``(groups, 2, d)`` and
    ``value_params`` ``(groups, G, 2, d / value_group)`` float16 — a :class:`~kvsieve.cache.quantized_tier.
    QuantizedTier`'s buffers; ``groups`` the groups to write, in the view's order (None: all, in order)."""
    tensors = (key_codes, key_params, value_codes, value_params, keys_out, values_out)
    if any(t.device.type != "cpu" for t in tensors) or (groups is not None and groups.device.type != "cpu"):
        return False
    out_kind = OUT_KINDS.get(keys_out.dtype)
    batch, heads, slots, dim = keys_out.shape
    count = key_codes.shape[0] if groups is None else groups.numel()
    if (out_kind is None or values_out.dtype != keys_out.dtype or values_out.shape != keys_out.shape
            or values_out.stride() != keys_out.stride() or keys_out.stride(3) != 1
            or key_params.dtype != torch.float16 or value_params.dtype != torch.float16
            or key_codes.dtype != torch.uint8 or value_codes.dtype != torch.uint8
            or not all(t.is_contiguous() for t in tensors[:4]) or dim > MAX_DIM or slots % group
            or count != batch * heads * (slots // group) or count == 0
            or (groups is not None and (groups.dtype != torch.int64 or not groups.is_contiguous()))):
        return False
    kernel = _kernel()
    if kernel is None:
        return False
    status = kernel(bits, group, dim, value_group, count, slots // group,
                    None if groups is None else groups.data_ptr(), key_codes.data_ptr(), key_params.data_ptr(),
                    value_codes.data_ptr(), value_params.data_ptr(), heads, keys_out.data_ptr(),
                    values_out.data_ptr(), out_kind, keys_out.stride(0), keys_out.stride(1), keys_out.stride(2))
    return status == 0
