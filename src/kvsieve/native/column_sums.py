"""A causal bfloat16 or float32 prompt's column sums from the flash kernel's log-sum-exp, with the CPU's bfloat16 dot
products (``statistics.c``: ``kvsieve_causal_column_sums``) or float32 fused multiply-adds (``fused_attention.c``:
``kvsieve_causal_column_sums_f32``).

:mod:`kvsieve.attention.flash_statistics` takes H2O's and EMS's statistic ``Σ_t exp(s·q_t·k_j − lse_t)`` from the
log-sum-exp SDPA's flash kernel returns. In PyTorch that is a float32 copy of the queries and keys, a float32 ``q·k``
product over the causal matrix, a subtraction and an ``exp`` per block: on a CPU whose matrix units run bfloat16
(AMX), ~100 ms per layer of a 4k prompt beside the kernel's 34. This pass multiplies the bfloat16 pairs exactly into
float32 sums (AVX512-BF16) and keeps each key's sum in a vector lane, one ``ctypes`` call per layer: within float32
rounding of the PyTorch path (the order of the sums, a polynomial ``exp``).

A float32 prompt (session 31) takes the float32 pass of ``fused_attention.c`` without its output: per sixteen
queries the logits against the keys they see (AVX-512, or AVX2 and FMA), ``exp(s·logit − lse_t)`` with a polynomial
``exp``, the column sums; no values, no ``P·V``. So a float32 prompt's default prefill keeps SDPA's output (the flash
kernel's, bit for bit) and pays one ``q·k`` product and one exponential per probability for the sums, where the
softmax pass took a row maximum, a division and a second read of the logits too.

:func:`causal_column_sums` returns None for anything it does not take (off the CPU, neither bfloat16 nor float32, a
head size that is odd or above 256 — for float32 not a multiple of 16 —, a CPU or build without AVX512-BF16 for
bfloat16 or without vector code for float32, no built library): the caller then takes its PyTorch path.
"""

from __future__ import annotations

import ctypes

import torch

from kvsieve.native import build
from kvsieve.native.build import F32, I64, PTR

#: The argument types of ``kvsieve_causal_column_sums`` (``statistics.c``).
ARGUMENTS = (I64, I64, I64, I64, I64, PTR, I64, I64, I64, PTR, I64, I64, I64, PTR, F32, PTR)


def _kernel(dtype: torch.dtype) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if dtype == torch.float32:
        return build.function("fused_attention", "kvsieve_causal_column_sums_f32", ARGUMENTS)
    return build.function("statistics", "kvsieve_causal_column_sums", ARGUMENTS)


def bf16_dot() -> bool:
    """Whether the pass runs here: built, with the CPU's bfloat16 dot products (AVX512-BF16)."""
    probe = build.function("statistics", "kvsieve_bf16_dot", ())
    return probe is not None and bool(probe())


def causal_column_sums(query: torch.Tensor, keys: torch.Tensor, logsumexp: torch.Tensor, scaling: float
                       ) -> torch.Tensor | None:
    """``Σ_{t ≥ j} exp(scaling·q_t·k_j − lse_t)`` ``(batch, q_heads, n)`` float32 of a causal prompt: ``query``
    ``(batch, q_heads, n, d)`` and ``keys`` ``(batch, kv_heads, n, d)`` bfloat16 or float32 (any strides but a unit one
    over ``d``), ``logsumexp`` ``(batch, q_heads, n)`` float32 (each query's, over the keys up to its own position).
    None where the pass does not apply (module docstring)."""
    batch, q_heads, n, dim = query.shape
    kv_heads = keys.shape[1]
    groups = q_heads // kv_heads if kv_heads else 0
    multiple = {torch.bfloat16: 2, torch.float32: 16}.get(query.dtype)
    if (multiple is None or query.device.type != "cpu" or keys.device.type != "cpu"
            or logsumexp.device.type != "cpu" or keys.dtype != query.dtype or logsumexp.dtype != torch.float32
            or groups < 1 or groups * kv_heads != q_heads or keys.shape != (batch, kv_heads, n, dim)
            or logsumexp.shape != (batch, q_heads, n) or dim % multiple or dim > 256 or n < 1
            or query.stride(3) != 1 or keys.stride(3) != 1):
        return None
    kernel = _kernel(query.dtype)
    if kernel is None:
        return None
    shifts = logsumexp.contiguous()
    out = torch.empty((batch, q_heads, n), dtype=torch.float32)
    status = kernel(batch, kv_heads, groups, dim, n, query.data_ptr(), query.stride(0), query.stride(1),
                    query.stride(2), keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
                    shifts.data_ptr(), scaling, out.data_ptr())
    return out if status == 0 else None
