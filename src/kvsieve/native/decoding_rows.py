"""A decoding query's attention output and its float32 softmax rows in one pass, on the CPU (``tiers.c``:
``kvsieve_attend_rows``).

A layer that compacts at every decoding step (``h2o``, ``tova``, ``ems`` with ``schedule="decode"``) scores from the
new query's softmax row over its held entries, and its output is that row times the values
(:meth:`~kvsieve.core.step.LayerStep.decoding_output_from_row`). In PyTorch that is a float32 copy of every held key
and value per layer and step, a ``q·k`` product, a softmax and a ``P·V`` product. This pass reads the keys and values
where they lie in the model's dtype, and writes the output rows (in the query's dtype) and the float32 rows in one
``ctypes`` call: within float32 rounding of the PyTorch path (the order of the sums, a polynomial ``exp``).

:func:`attend` returns None for anything it does not take (off the CPU, a head size not a multiple of 8 or above 256,
more than 16 query heads per KV head, a CPU without AVX2/FMA/F16C, no built library): the caller then takes its
PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch

from kvsieve.native import build
from kvsieve.native.build import F32, I32, I64, PTR
from kvsieve.native.dequantize import OUT_KINDS

#: The argument types of ``kvsieve_attend_rows`` (``tiers.c``).
ARGUMENTS = (I32, I32, I32, I32, PTR, I32, I64, I64, PTR, F32, PTR, PTR, I32, I64, I64, I64, I64,
             PTR, PTR, I64, I32, PTR)


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return build.function("tiers", "kvsieve_attend_rows", ARGUMENTS)


def attend(query: torch.Tensor, scaling: float, keys: torch.Tensor, values: torch.Tensor,
           valid: torch.Tensor | None, bias: torch.Tensor | None, *,
           counts: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Softmax attention of ``query`` ``(batch, q_heads, 1, d)`` over ``keys``/``values`` ``(batch, kv_heads, L, d)``
    (any strides but a unit stride over ``d``, the same for both), ``valid`` ``(batch, kv_heads, L)`` bool or None,
    ``bias`` ``(batch, kv_heads, L)`` added to every logit of its entry (None: none) — with ``counts``, EMS's merge
    counts, whose ``log(max(count, 1))`` the pass adds (:func:`~kvsieve.core.step.count_bias`, within an ulp: the C
    library's ``logf``), read in place from a store's side data (issue 22: the bias's four operations per layer and
    step). Returns the output ``(batch, 1, q_heads, d)`` in the query's dtype and the rows ``(batch, q_heads, 1, L)``
    float32 (invalid entries 0), or None where the pass does not apply (module docstring; a row that sees no entry
    included)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    rows = q_heads // kv_heads if kv_heads else 0
    kind, query_kind = OUT_KINDS.get(keys.dtype), OUT_KINDS.get(query.dtype)
    if (query.device.type != "cpu" or keys.device.type != "cpu" or q_len != 1 or kind is None or query_kind is None
            or dim % 8 or dim > 256 or rows < 1 or rows > 16 or rows * kv_heads != q_heads or length < 1
            or query.stride(3) != 1 or values.dtype != keys.dtype or values.shape != keys.shape
            or values.stride() != keys.stride() or keys.stride(3) != 1 or keys.shape[0] != batch
            or (valid is not None and (valid.dtype != torch.bool or valid.shape != keys.shape[:3]))
            or (bias is not None and bias.shape != keys.shape[:3])):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    ok = None if valid is None else valid.contiguous()
    offsets, offsets_stride = None, 0
    if bias is not None:
        offsets_stride = segment_stride(bias)
        offsets = bias
        if bias.dtype != torch.float32 or offsets_stride is None or offsets_stride < length:
            offsets = bias.float().contiguous()
            offsets_stride = length
    out = torch.empty((batch, 1, q_heads, dim), dtype=query.dtype)
    probs = torch.empty((batch, q_heads, 1, length), dtype=torch.float32)
    status = kernel(batch, kv_heads, rows, dim, query.data_ptr(), query_kind, query.stride(0), query.stride(1),
                    out.data_ptr(), scaling, keys.data_ptr(), values.data_ptr(), kind, keys.stride(0), keys.stride(1),
                    keys.stride(2), length, None if ok is None else ok.data_ptr(),
                    None if offsets is None else offsets.data_ptr(), offsets_stride, int(counts), probs.data_ptr())
    return (out, probs) if status == 0 else None


def segment_stride(t: torch.Tensor) -> int | None:
    """The elements between consecutive (batch item, head) rows of ``t`` ``(batch, heads, L)`` read as one run of
    rows (unit stride over ``L``), or None where they are not evenly spaced."""
    batch, heads, length = t.shape
    if length > 1 and t.stride(2) != 1:
        return None
    if heads == 1:
        return t.stride(0) if batch > 1 else length
    if batch > 1 and t.stride(0) != heads * t.stride(1):
        return None
    return t.stride(1)
