"""Single-entry removal errors: how much one head's output moves when one KV entry is evicted.

Removing entry ``j`` from a softmax row ``A`` renormalises the rest by ``1 / (1 - A[j])``, so the
output moves by exactly ``A[j] / (1 - A[j]) · (o - v_j)``. Two papers score entries with this:

* ReST-KV (An et al., 2026, ICLR 2026, arXiv:2605.08840), Eq. 7 — the change of the head's contribution
  ``o W_O^h`` to the layer output, for every observation-window query (derivation in App. A, Eq. 15–23);
* CAOTE (Goel et al., 2025, arXiv:2504.14051), Eq. 6 — the change of the head output ``o`` for the
  current query; Eq. 7 its meta-policy form over any base score; Eq. 8 FastCAOTE (mean value for ``o``).

Shapes: ``rows`` ``(batch, q_heads, w, L)`` softmax rows; ``outputs`` ``(batch, q_heads, w, d)`` the
matching ``o_t``; ``values`` ``(batch, kv_heads, L, d)`` (query head ``i`` reads KV head
``i // groups``); per-KV-head scores ``(batch, kv_heads, L)``. Everything runs in float32 (or float64
when given float64) and never materialises a ``(w, L, d)`` or ``(w, L, hidden)`` difference.
"""

from __future__ import annotations

import torch

#: Lower clamp of ``1 - A`` (an entry holding all the attention would otherwise divide by zero).
EPS = 1e-6


def _dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(batch, q_heads, ...)`` → ``(batch, kv_heads, groups, ...)`` (query head ``i`` → KV head ``i // groups``)."""
    return t.reshape(t.shape[0], kv_heads, t.shape[1] // kv_heads, *t.shape[2:])


def removal_weight(attention: torch.Tensor) -> torch.Tensor:
    """``A / (1 - A)`` with ``1 - A`` clamped to ``EPS`` (ReST-KV Eq. 7, CAOTE Eq. 6)."""
    return attention / (1.0 - attention).clamp(min=EPS)


def output_gram(o_proj_weight: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Per-head Gram matrices ``G_h = W_O^h W_O^hᵀ``, ``(q_heads, d, d)``.

    ``o_proj_weight`` is ``o_proj.weight`` ``(hidden, q_heads·d)``; ``W_O^h`` (``d × hidden``) is its
    columns ``h·d:(h+1)·d`` transposed, so ``‖x W_O^h‖² = x G_h xᵀ``.
    """
    hidden = o_proj_weight.shape[0]
    dtype = _dtype(o_proj_weight)
    per_head = o_proj_weight.to(dtype).reshape(hidden, q_heads, -1)
    return torch.einsum("khd,khe->hde", per_head, per_head)


def output_distances(outputs: torch.Tensor, values: torch.Tensor, gram: torch.Tensor | None) -> torch.Tensor:
    """``‖(o_t - v_j) W_O^h‖₂`` (or ``‖o_t - v_j‖₂`` when ``gram`` is None), ``(batch, q_heads, w, L)``.

    Expanded as ``o G oᵀ - 2 o G v_jᵀ + v_j G v_jᵀ``: cost ``O(w·L·d + L·d²)`` per head, like the
    attention rows themselves. The cross term is one batched product per KV head (its query heads'
    ``-2 o G`` rows stacked against the shared values, never a per-query-head copy of the values); the
    ``v G vᵀ`` term is one ``(L × d)·(d × g·d)`` product per KV head; the three terms are summed in place
    and the square is clamped at 0 against rounding before the root. The expansion cancels when
    ``o_t ≈ v_j`` (an entry holding nearly all the attention): in float32 its relative error is ~1e-7
    for ordinary entries but ~5% at ``A = 0.999`` — such an entry still ranks at the top.
    """
    dtype = _dtype(outputs, values)
    batch, q_heads, w, d = outputs.shape
    kv_heads, length = values.shape[1], values.shape[2]
    groups = q_heads // kv_heads
    o = _grouped(outputs.to(dtype), kv_heads)  # (b, kv, g, w, d)
    v = values.to(dtype)  # (b, kv, L, d)
    if gram is None:
        o_g = o
        v_sq = (v * v).sum(-1)[:, :, None, None, :]  # (b, kv, 1, 1, L)
    else:
        g = gram.to(dtype).reshape(kv_heads, groups, d, d)
        o_g = torch.matmul(o, g)  # (b, kv, g, w, d)
        stacked = g.permute(0, 2, 1, 3).reshape(kv_heads, d, groups * d)  # [G_1 | ... | G_g] per KV head
        v_g = torch.matmul(v, stacked).view(batch, kv_heads, length, groups, d)  # (b, kv, L, g, d)
        v_sq = (v_g * v.unsqueeze(3)).sum(-1).permute(0, 1, 3, 2).unsqueeze(3)  # (b, kv, g, 1, L)
    o_sq = (o_g * o).sum(-1, keepdim=True)  # (b, kv, g, w, 1)
    cross = torch.matmul(o_g.reshape(batch, kv_heads, groups * w, d), v.transpose(-1, -2))
    squared = cross.view(batch, kv_heads, groups, w, length).mul_(-2.0).add_(o_sq).add_(v_sq)
    return squared.clamp_(min=0.0).sqrt_().flatten(1, 2)


def restkv_indicator(
    rows: torch.Tensor, outputs: torch.Tensor, values: torch.Tensor, gram: torch.Tensor | None
) -> torch.Tensor:
    """ReST-KV Eq. 7: ``I_t[j] = A[t,j] / (1 - A[t,j]) · ‖(o_t - v_j) W_O^h‖₂``, ``(batch, q_heads, w, L)``.

    ``gram`` from :func:`output_gram`; None gives the "w/o W_O" ablation ``‖o_t - v_j‖₂``.
    """
    attention = rows.to(_dtype(rows, outputs, values))
    distances = output_distances(outputs, values, gram)
    return distances.mul_(attention).div_((1.0 - attention).clamp_(min=EPS))


def vatp_indicator(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ReST-KV Table 15's "attention weights and values" (VATP-like) indicator ``A[t,j] · ‖v_j‖₂``."""
    dtype = _dtype(rows, values)
    norms = values.to(dtype).norm(dim=-1)  # (b, kv, L)
    grouped = _grouped(rows.to(dtype), values.shape[1]) * norms[:, :, None, None, :]
    return grouped.flatten(1, 2)


def caote_scores(attention: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """CAOTE Eq. 6: ``c_j = α_j / (1 - α_j) · ‖v_j - o‖₂`` with ``o = Σ_i α_i v_i``.

    ``attention`` ``(batch, q_heads, L)`` is the current query's softmax row; returns ``(batch, q_heads, L)``,
    the exact output change when entry ``j`` alone is evicted (App. A, Eq. 16).
    """
    rows = attention.unsqueeze(2)
    kv_heads = values.shape[1]
    dtype = _dtype(attention, values)
    outputs = torch.matmul(_grouped(rows.to(dtype), kv_heads).flatten(2, 3), values.to(dtype))
    outputs = outputs.reshape(attention.shape[0], attention.shape[1], 1, -1)
    return restkv_indicator(rows, outputs, values, None)[:, :, 0]


def caote_meta_scores(
    base: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None, fast: bool = False
) -> torch.Tensor:
    """CAOTE as a meta-policy over a base score ``h`` (``(batch, heads, L)``, ≥ 0; ``values`` per head).

    ``h̃ = h / Σ_i h_i`` (Sec. 3.3; a no-op for TOVA's attention row, the normalisation H2O's
    accumulators need, App. C.1), then

    * Eq. 7: ``c_j = h̃_j / (1 - h̃_j) · ‖Σ_i h̃_i v_i - v_j‖₂²`` (squared, as printed);
    * ``fast`` — FastCAOTE Eq. 8: ``c_j = h̃_j / (1 - h̃_j) · ‖v̄ - v_j‖₂`` with ``v̄`` the plain mean of the
      head's held values (``1/(b+1) Σ_i v_i``, Sec. 3.4), not squared, as printed.

    ``valid`` ``(batch, heads, L)`` marks real entries (padding gets 0 and is left out of sums and means).
    Negative base scores are clipped to 0. The result replaces the base score: lowest ``c`` is evicted.
    """
    dtype = _dtype(base, values)
    h = base.to(dtype).clamp(min=0.0)
    v = values.to(dtype)
    if valid is not None:
        h = h.masked_fill(~valid, 0.0)
        v = v.masked_fill(~valid.unsqueeze(-1), 0.0)
    h_norm = h / h.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(dtype).tiny)
    if fast:
        count = v.shape[-2] if valid is None else valid.sum(dim=-1, keepdim=True).clamp(min=1)
        centre = v.sum(dim=-2) / count
        distance = (v - centre.unsqueeze(-2)).norm(dim=-1)
    else:
        centre = torch.matmul(h_norm.unsqueeze(-2), v).squeeze(-2)
        distance = (v - centre.unsqueeze(-2)).pow(2).sum(dim=-1)
    scores = removal_weight(h_norm) * distance
    return scores if valid is None else scores.masked_fill(~valid, 0.0)
