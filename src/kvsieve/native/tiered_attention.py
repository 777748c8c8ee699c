"""A decoding query's attention over a tiered store read in place, on the CPU (``tiers.c``: ``kvsieve_attend_tiered``).

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
from dataclasses import dataclass, field

import torch

from kvsieve.native import build
from kvsieve.native.build import F32, I32, I64, PTR
from kvsieve.native.dequantize import OUT_KINDS


@dataclass(frozen=True)
class PackedTier:
    """One tier's buffers and slot layout as :meth:`~kvsieve.cache.quantized_tier.QuantizedTier.attention_layout`
    gives it: ``index`` the groups in layout order (None: all, in order), ``valid`` ``(batch, heads, slots)`` bool
    (None: every slot holds an entry), ``slots`` per segment. ``descriptor`` is what ``tiers.c`` reads (the fields
    and the tensors' addresses, ``T_FIELDS`` int64): valid while this object holds the tensors and the tier does
    not change (its owner keeps one per tier version)."""

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
    descriptor: torch.Tensor = field(init=False, repr=False)
    #: Whether ``tiers.c`` can read this tier (on the CPU, contiguous, in the dtypes it reads).
    readable: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        index = None if self.index is None else self.index.contiguous()
        valid = None if self.valid is None else self.valid.contiguous()
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "valid", valid)
        readable = (self.key_codes.device.type == "cpu" and self.key_params.dtype == torch.float16
                    and self.value_params.dtype == torch.float16 and self.slots % self.group == 0
                    and all(t.is_contiguous() for t in (self.key_codes, self.key_params, self.value_codes,
                                                         self.value_params))
                    and (index is None or index.dtype == torch.int64) and (valid is None or valid.dtype == torch.bool))
        fields = [self.bits, self.group, self.value_group, self.slots // self.group, _address(index),
                  self.key_codes.data_ptr(), self.key_params.data_ptr(), self.value_codes.data_ptr(),
                  self.value_params.data_ptr(), _address(valid)] if readable else [0] * 10
        object.__setattr__(self, "descriptor", torch.tensor(fields, dtype=torch.int64))
        object.__setattr__(self, "readable", readable)


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


#: The argument types of ``kvsieve_attend_tiered`` (``tiers.c``).
ARGUMENTS = (I32, I32, I32, I32, PTR, I32, I64, I64, PTR, F32, PTR, PTR, I32, I64, I64, I64, I64,
             PTR, I32, PTR)


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return build.function("tiers", "kvsieve_attend_tiered", ARGUMENTS)


def attend(query: torch.Tensor, scaling: float, keys: torch.Tensor, values: torch.Tensor,
           valid: torch.Tensor | None, tiers: list[PackedTier]) -> torch.Tensor | None:
    """Softmax attention of ``query`` ``(batch, q_heads, 1, d)`` over the full-precision entries ``keys``/``values``
    ``(batch, kv_heads, L, d)`` (any strides but a unit stride over ``d``; ``valid`` ``(batch, kv_heads, L)`` bool or
    None) and every tier's entries: ``(batch, 1, q_heads, d)`` in the query's dtype, or None where the pass does not
    apply (module docstring). One C call: each (batch item, KV head) reads its query rows, its full-precision
    entries and every tier, and writes its output rows."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = keys.shape[1]
    rows = q_heads // kv_heads if kv_heads else 0
    kind, query_kind = OUT_KINDS.get(keys.dtype), OUT_KINDS.get(query.dtype)
    if (query.device.type != "cpu" or keys.device.type != "cpu" or q_len != 1 or kind is None or query_kind is None
            or dim % 8 or dim > 256 or rows < 1 or rows > 16 or rows * kv_heads != q_heads or query.stride(3) != 1
            or values.dtype != keys.dtype or values.shape != keys.shape or values.stride() != keys.stride()
            or keys.stride(3) != 1 or (valid is not None and valid.dtype != torch.bool)
            or not all(tier.readable for tier in tiers)):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    descriptors = None
    if tiers:
        descriptors = tiers[0].descriptor if len(tiers) == 1 else torch.cat([tier.descriptor for tier in tiers])
    ok = None if valid is None else valid.contiguous()
    out = torch.empty((batch, 1, q_heads, dim), dtype=query.dtype)
    status = kernel(batch, kv_heads, rows, dim, query.data_ptr(), query_kind, query.stride(0), query.stride(1),
                    out.data_ptr(), scaling, keys.data_ptr(), values.data_ptr(), kind, keys.stride(0), keys.stride(1),
                    keys.stride(2), keys.shape[2], _address(ok), len(tiers),
                    None if descriptors is None else descriptors.data_ptr())
    return out if status == 0 else None
