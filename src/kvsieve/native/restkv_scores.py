"""ReST-KV's window scores at a prompt's compaction in one C pass (``reconstruction.c``:
``kvsieve_restkv_window_scores``): the indicator of Eq. 7 for every window query and entry before the window, its
temporal smoothing (Eq. 9's EMA weights, or the mean), each window query's mean top-``k`` index (Eq. 10's inner sum)
and, when asked, the adaptive window of Eq. 10–13 itself (:func:`kvsieve.ops.smoothing.drift_window_mean`'s widths,
shifts and float64 window means, bit for bit given the same unsmoothed scores), without the ``(batch, q_heads, w, L)``
float32 intermediates of the PyTorch path (:func:`kvsieve.ops.reconstruction.restkv_indicator`,
:func:`kvsieve.ops.smoothing.top_index_mean`): ~14 of ReST-KV's ~16 ms per 4k layer over SnapKV's were those tensors'
passes and the top-k; the adaptive window's small operations another ~1.2 ms.

Within float32 rounding of the PyTorch path (the same expansion ``o G oᵀ − 2 o G vᵀ + v G vᵀ``, summed in another
order); where entries tie at the ``k``-th largest indicator the lowest indices count (``torch.topk`` takes any).
:func:`window_scores` returns None for anything it does not take (off the CPU, dtypes or shapes other than below, a
build with neither AVX-512 nor AVX2 and FMA): the caller then takes the PyTorch path. AVX2 takes blocks of eight entries
where AVX-512 takes sixteen; each entry's numbers are the same, bit for bit.
"""

from __future__ import annotations

import torch

from kvsieve.native import build
from kvsieve.native.build import F32, F64, I32, I64, PTR

#: The argument types of ``kvsieve_restkv_window_scores`` (``reconstruction.c``).
ARGUMENTS = (I64, I64, I64, I64, I64, I64, I64, PTR, PTR, PTR, I32, I64, I64, I64, PTR, PTR, PTR, F32,
             I32, F64, I64, I32, PTR, PTR)
#: The adaptive window's width rules, by their code in the pass.
RULES = {"max": 0, "sum": 1}
#: The value dtypes the pass reads, by its code for them.
KINDS = {torch.float32: 0, torch.bfloat16: 1}
#: The longest window and the largest head size the pass takes.
MOST_WINDOW, MOST_DIM = 128, 256


def vector_code() -> bool:
    """Whether the pass runs here: built, with AVX-512 or with AVX2 and FMA."""
    probe = build.function("reconstruction", "kvsieve_restkv_vector_code", ())
    return probe is not None and bool(probe())


def computes_outputs(values: torch.Tensor) -> bool:
    """Whether :func:`window_scores` takes ``outputs=None`` for these values: it then computes the window's outputs
    ``o_t = Σ_j A[t, j] v_j`` itself, and its three products run on the AMX tiles (bfloat16 values on the CPU, a head
    size a multiple of 32, a build with AMX that the kernel grants the tiles to)."""
    if values.device.type != "cpu" or values.dtype != torch.bfloat16 or values.shape[-1] % 32:
        return False
    probe = build.function("reconstruction", "kvsieve_restkv_tiles", ())
    return probe is not None and bool(probe())


def window_scores(rows: torch.Tensor, outputs: torch.Tensor | None, values: torch.Tensor, gram: torch.Tensor | None,
                  weights: torch.Tensor, budgets: torch.Tensor | None, prefix: int, eps: float,
                  drift: tuple[float, int, str] | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(smoothed, per_query)``: ``smoothed`` ``(batch, q_heads, L)`` float32, ``Σ_t weights[t]·I[t, j]`` for the
    entries ``j < prefix`` and 0 from the window on; ``per_query`` ``(batch, q_heads, w)`` float32, the mean index of
    each window query's ``budgets`` largest ``I[t, j < prefix]`` (all of them where fewer; None without ``budgets``).
    With ``drift = (beta, base, rule)`` (and ``budgets``), ``smoothed`` is then
    ``drift_window_mean(smoothed, per_query if w >= 2 else None, beta, None, base, rule)`` (Eq. 10–13).

    ``rows`` ``(batch, q_heads, w, L)`` and ``outputs`` ``(batch, q_heads, w, d)`` float32 contiguous (the window's
    softmax rows and outputs; ``outputs=None`` where :func:`computes_outputs`: from ``rows`` and ``values`` here, within
    float32 rounding of ``rows @ values``), ``values`` ``(batch, kv_heads, L, d)`` float32 or bfloat16 (unit stride over
    ``d``),
    ``gram`` ``(q_heads, d, d)`` float32 contiguous or None (the "w/o W_O" ablation), ``weights`` ``(w,)`` float32,
    ``budgets`` ``(batch, q_heads)`` int64. None where the pass does not apply (module docstring)."""
    batch, q_heads, w, length = rows.shape
    kv_heads, dim = values.shape[1], values.shape[-1]
    groups = q_heads // kv_heads if kv_heads else 0
    kind = KINDS.get(values.dtype)
    tensors = tuple(t for t in (rows, outputs, values, weights, gram, budgets) if t is not None)
    beta, base, rule = drift if drift is not None else (1.0, 1, "max")
    if (any(t.device.type != "cpu" for t in tensors) or kind is None or rows.dtype != torch.float32
            or weights.dtype != torch.float32 or not rows.is_contiguous() or not weights.is_contiguous()
            or values.stride(3) != 1
            or groups < 1 or groups * kv_heads != q_heads or values.shape != (batch, kv_heads, length, dim)
            or weights.shape != (w,) or not 1 <= w <= MOST_WINDOW
            or not 1 <= dim <= MOST_DIM or not 0 <= prefix <= length
            or (drift is not None and (budgets is None or not beta > 0 or base < 1 or rule not in RULES))
            or (gram is not None and (gram.dtype != torch.float32 or not gram.is_contiguous()
                                      or gram.shape != (q_heads, dim, dim)))
            or (budgets is not None and (budgets.dtype != torch.long or not budgets.is_contiguous()
                                         or budgets.shape != (batch, q_heads)))):
        return None
    if outputs is None:
        if not computes_outputs(values):
            return None
    elif (outputs.dtype != torch.float32 or not outputs.is_contiguous()
          or outputs.shape != (batch, q_heads, w, dim)):
        return None
    kernel = build.function("reconstruction", "kvsieve_restkv_window_scores", ARGUMENTS)
    if kernel is None:
        return None
    smoothed = torch.empty((batch, q_heads, length), dtype=torch.float32)
    per_query = torch.empty((batch, q_heads, w), dtype=torch.float32) if budgets is not None else None
    status = kernel(batch, kv_heads, groups, w, length, dim, prefix, rows.data_ptr(),
                    None if outputs is None else outputs.data_ptr(),
                    values.data_ptr(), kind, values.stride(0), values.stride(1), values.stride(2),
                    None if gram is None else gram.data_ptr(), weights.data_ptr(),
                    None if budgets is None else budgets.data_ptr(), eps, int(drift is not None), float(beta),
                    int(base), RULES[rule], smoothed.data_ptr(),
                    None if per_query is None else per_query.data_ptr())
    return (smoothed, per_query) if status == 0 else None
