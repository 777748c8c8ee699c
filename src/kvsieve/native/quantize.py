"""KIVI quantization of a tier's new groups in one C pass (``tiers.c``: ``kvsieve_quantize``), on the CPU.

:meth:`~kvsieve.cache.quantized_tier.QuantizedTier.add` quantizes the entries a compaction demotes: per group the
keys' per-channel bounds over its valid slots, the values' per-token bounds, float16 steps and minimums, the codes and
their packing — about thirty tensor operations per layer in PyTorch. The C pass computes the same codes and
parameters bit for bit (float32 arithmetic in the same order, round half to even, float16 rounding to nearest even)
in one call. :func:`quantize_groups` returns None for anything it does not take (off the CPU, no built library); the
caller then runs its PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch

from kvsieve.native import build
from kvsieve.native.build import I32, I64, PTR

#: The argument types of ``kvsieve_quantize`` (``tiers.c``).
ARGUMENTS = (I32, I32, I32, I32, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR)


def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return build.function("tiers", "kvsieve_quantize", ARGUMENTS)


def quantize_groups(bits: int, group: int, value_group: int, keys: torch.Tensor, values: torch.Tensor,
                    valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``keys``/``values`` ``(groups, G, d)`` float32 and ``valid`` ``(groups, G)`` bool → key codes ``(groups, G,
    width)``, key params ``(groups, 2, d)``, value codes ``(groups·G, width)`` and value params ``(groups·G, 2,
    d / value_group)`` (float16): what ``QuantizedTier._quantize_keys`` / ``_quantize_values`` return, or None."""
    groups, g, dim = keys.shape
    if (keys.device.type != "cpu" or keys.dtype != torch.float32 or values.dtype != torch.float32
            or values.shape != keys.shape or valid.shape != (groups, g) or valid.dtype != torch.bool or g != group):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    keys, values, valid = keys.contiguous(), values.contiguous(), valid.contiguous()
    width = -(-dim * bits // 8)
    key_codes = torch.empty((groups, g, width), dtype=torch.uint8)
    key_params = torch.empty((groups, 2, dim), dtype=torch.float16)
    value_codes = torch.empty((groups * g, width), dtype=torch.uint8)
    value_params = torch.empty((groups * g, 2, dim // value_group), dtype=torch.float16)
    status = kernel(bits, group, dim, value_group, groups, keys.data_ptr(), values.data_ptr(), valid.data_ptr(),
                    key_codes.data_ptr(), key_params.data_ptr(), value_codes.data_ptr(), value_params.data_ptr())
    return None if status else (key_codes, key_params, value_codes, value_params)
