"""A causal bfloat16 prompt's attention output, log-sum-exp and column sums from one pass on the CPU's AMX tiles
(``fused_attention.c``: ``kvsieve_causal_attention_with_column_sums``).

SDPA's flash kernel followed by the column sums from its log-sum-exp (:mod:`kvsieve.native.column_sums`) takes every
``q·k`` product and every exponential twice. This pass takes each once: per sixteen queries the logits against the
keys they see (tiles), each query's exact maximum, one exponential per probability (vector units), ``P·V`` (tiles) and
the sums. It is the paper of EMS's fused statistic (Li et al. 2024, arXiv:2412.08521, Sec. 3.3), for
``fuse_statistics=True``: the output is within bfloat16 rounding of SDPA's, not bit for bit (the probabilities are
rounded to bfloat16 against the exact maximum, where PyTorch's flash kernel rounds them against a running one), and
the sums within float32 rounding of the float64 softmax.

:func:`causal_attention_with_column_sums` returns None for anything it does not take (off the CPU, not bfloat16, a
head size that is not a multiple of 32 or above 256, a CPU or build without AMX-BF16, no built library): the caller
then takes its other routes.

A float32 prompt takes the same pass with fused multiply-adds on the vector units instead of the tiles
(``kvsieve_causal_attention_with_column_sums_f32``; head sizes that are multiples of 16): AVX-512, or on a CPU with
AVX2 and FMA but no AVX-512 (an AVX2-only CPU) the same pass on eight lanes. The probabilities multiply the values in
float32, so its output is within float32 rounding of the exact attention (SDPA's float32 kernel's is too, rounded
otherwise).
"""

from __future__ import annotations

import torch

from kvsieve.native import build
from kvsieve.native.build import F32, I64, PTR

#: The argument types of ``kvsieve_causal_attention_with_column_sums`` (``fused_attention.c``).
ARGUMENTS = (I64, I64, I64, I64, I64, PTR, I64, I64, I64, PTR, I64, I64, I64, PTR, I64, I64, I64, F32, PTR, I64, I64,
             I64, PTR, PTR)


def vector_code() -> bool:
    """Whether the float32 pass runs here: built, with AVX-512 or with AVX2 and FMA."""
    probe = build.function("fused_attention", "kvsieve_fused_attention_vector_code", ())
    return probe is not None and bool(probe())


def tiles() -> bool:
    """Whether the pass runs here: built, with AMX-BF16 tiles in the build (the CPU must grant them too)."""
    probe = build.function("fused_attention", "kvsieve_fused_attention_tiles", ())
    return probe is not None and bool(probe())


def causal_attention_with_column_sums(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(output, logsumexp, sums)`` of a causal prompt over its own entries: ``query`` ``(batch, q_heads, n, d)``,
    ``keys``/``values`` ``(batch, kv_heads, n, d)`` bfloat16 or float32 (any strides but a unit one over ``d``);
    ``output`` ``(batch, n, q_heads, d)`` in their dtype, ``logsumexp`` and ``sums`` (``Σ_{t ≥ j} A[t, j]``)
    ``(batch, q_heads, n)`` float32. None where the pass does not apply (module docstring)."""
    batch, q_heads, n, dim = query.shape
    kv_heads = keys.shape[1]
    groups = q_heads // kv_heads if kv_heads else 0
    tensors = (query, keys, values)
    dtype = query.dtype
    multiple = {torch.bfloat16: 32, torch.float32: 16}.get(dtype)  # the tiles' head sizes, the float32 pass's
    if (multiple is None or any(t.device.type != "cpu" or t.dtype != dtype or t.stride(3) != 1 for t in tensors)
            or groups < 1 or groups * kv_heads != q_heads or keys.shape != (batch, kv_heads, n, dim)
            or values.shape != keys.shape or dim % multiple or dim > 256 or n < 1):
        return None
    symbol = "kvsieve_causal_attention_with_column_sums" + ("_f32" if dtype == torch.float32 else "")
    kernel = build.function("fused_attention", symbol, ARGUMENTS)
    if kernel is None:
        return None
    output = torch.empty((batch, n, q_heads, dim), dtype=dtype)
    logsumexp = torch.empty((batch, q_heads, n), dtype=torch.float32)
    sums = torch.empty((batch, q_heads, n), dtype=torch.float32)
    status = kernel(batch, kv_heads, groups, dim, n, query.data_ptr(), *query.stride()[:3], keys.data_ptr(),
                    *keys.stride()[:3], values.data_ptr(), *values.stride()[:3], scaling, output.data_ptr(),
                    output.stride(0), output.stride(1), output.stride(2), logsumexp.data_ptr(), sums.data_ptr())
    return (output, logsumexp, sums) if status == 0 else None
