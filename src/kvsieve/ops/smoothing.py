"""ReST-KV's spatial-temporal smoothing of per-query indicators (An et al., 2026, ICLR 2026, arXiv:2605.08840,
Sec. 3.3, Eq. 8–13).

Input is an indicator ``I`` ``(batch, heads, w, L)``: one row per observation-window query ``t`` (in
order) over the ``L`` held entries. Temporal smoothing reduces the ``w`` rows to one score per entry
(EMA, Eq. 9); adaptive-window spatial smoothing then averages that score over a window whose width and
shift follow how far the important entries moved between the front and the rear half of the window
(Eq. 10–13). Everything is per head, so each head gets its own width and shift.
"""

from __future__ import annotations

import torch


def ema_over_window(indicator: torch.Tensor, alpha: float, query_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 9: ``E ← α·I_t + (1-α)·E`` over the window queries in order, starting with ``E = I_{t_1}``.

    ``indicator`` ``(batch, heads, w, L)``; ``query_valid`` ``(batch, w)`` (None: all real) — the
    recursion starts at each batch item's first real query and skips padding queries. Returns
    ``(batch, heads, L)``.

    Unrolled, the recursion is one weighted sum over the window (:func:`ema_weights`), computed as one matrix
    product instead of ``w`` steps of three operations each (on a GPU each step is three kernel launches the
    host must issue in turn). The result equals the recursion up to float rounding (the order of the sums).
    """
    batch, _, w, _ = indicator.shape
    valid = (torch.ones(batch, w, dtype=torch.bool, device=indicator.device) if query_valid is None
             else query_valid.to(device=indicator.device, dtype=torch.bool))
    weight = ema_weights(valid, alpha).to(indicator.dtype)
    return torch.matmul(weight[:, None, None, :], indicator).squeeze(2)


def ema_weights(valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """The weight of each window query in Eq. 9's EMA, ``(batch, w)`` float64: a real query followed by ``r`` real
    queries weighs ``α(1-α)^r``, the first real one ``(1-α)^r`` (the recursion starts from it), padding 0."""
    real = valid.to(torch.float64)
    later = real.flip(-1).cumsum(-1).flip(-1) - real  # real queries after each one
    first = valid & (real.cumsum(-1) == 1)
    decay = torch.pow(torch.full_like(real, 1.0 - alpha), later)
    return torch.where(first, decay, alpha * decay) * real


def mean_over_window(indicator: torch.Tensor, query_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Plain mean over the real window queries (Table 16 "Mean"; Table 3's "w/o EMA" ablation)."""
    if query_valid is None:
        return indicator.mean(dim=2)
    weight = query_valid.to(indicator.dtype)[:, None, :, None]
    return (indicator * weight).sum(dim=2) / weight.sum(dim=2).clamp(min=1.0)


def top_index_mean(indicator: torch.Tensor, k: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Mean index of each query's top-``k`` entries, ``(batch, heads, w)``: the inner sum of Eq. 10.

    ``indicator`` ``(batch, heads, w, L)``; ``k`` ``(batch, heads)`` (the budget ``B``); ``candidates``
    ``(batch, heads, L)`` marks the entries that compete (the prefix before the window). Fewer candidates
    than ``k`` → all of them.
    """
    length = indicator.shape[-1]
    if k.numel() == 0:
        return torch.zeros(indicator.shape[:3], dtype=indicator.dtype, device=indicator.device)
    count = candidates.sum(dim=-1)
    leading = (candidates[..., 1:] <= candidates[..., :-1]).all()  # every head's candidates are a leading run
    # one host read for every shape decision below
    k_high, k_low, prefix, most, leading_run = torch.stack([k.max().long(), k.min().long(), count.min(),
                                                           count.max(), leading.long()]).tolist()
    k_max = min(k_high, length)
    if k_max == 0:
        return torch.zeros(indicator.shape[:3], dtype=indicator.dtype, device=indicator.device)
    if most == prefix and k_max == k_low and k_max <= prefix and leading_run:
        # common case (no padding): the same leading ``prefix`` entries compete in every head, one k
        top = torch.topk(indicator[..., :prefix], k_max, dim=-1, sorted=False).indices
        return top.to(indicator.dtype).mean(dim=-1)
    masked = indicator.masked_fill(~candidates.unsqueeze(2), float("-inf"))
    values, index = torch.topk(masked, k_max, dim=-1)
    rank = torch.arange(k_max, device=indicator.device)
    chosen = (rank < k[:, :, None, None]) & (values > float("-inf"))
    count = chosen.sum(dim=-1).clamp(min=1).to(indicator.dtype)
    return (index.to(indicator.dtype) * chosen).sum(dim=-1) / count


def adaptive_window(
    d_front: torch.Tensor, d_rear: torch.Tensor, beta: float, base: int = 1, rule: str = "max"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 11–12 with a base kernel: width and shift ``γ`` (long tensors).

    ``rule="max"`` (default; the authors' code): ``W_s = max(base, 2⌊|ΔD|/β⌋ + 1)``, Eq. 11 as printed
    but never narrower than the base kernel. ``rule="sum"`` (kvsieve ≤ 0.1): ``W_s = base + 2⌊|ΔD|/β⌋``.
    The two agree whenever ``|ΔD| < β`` (every prompt shorter than β = 2000 tokens) and the ``max`` rule
    is narrower above.

    ``base = 1`` is Eq. 11 as printed. kvsieve's ReST-KV passes its ``kernel_size`` (App. B: ReST-KV
    uses SnapKV's k = 5, 21 on RULER), reading Eq. 11's ``+1`` as the base kernel the drift widens:
    printed literally, ``W_s = 1`` whenever the important entries drift by less than ``β`` = 2000
    tokens, i.e. no spatial smoothing at all on almost every prompt, which matches neither the 2.36-point
    "w/o AWS" ablation nor the kernel size App. B lists for ReST-KV.

    ``γ = trunc((D_front - D_rear)/β)`` (rounded towards zero). Eq. 12 prints ``⌊x⌋`` for ``x > 0`` and
    ``⌊x⌋ + 1`` for ``x ≤ 0``, which is the same except at whole ``x ≤ 0``, where it gives ``x + 1``
    — ``γ = 1`` for ``ΔD = 0``, shifting the window when nothing moved. kvsieve keeps it centred there.
    """
    delta = d_front - d_rear
    drift = 2 * torch.floor(delta.abs() / beta).long()
    if rule == "max":
        width = torch.clamp(drift + 1, min=base)
    elif rule == "sum":
        width = base + drift
    else:
        raise ValueError(f"rule must be 'max' or 'sum'; got {rule!r}")
    shift = torch.trunc(delta / beta).long()
    return width, shift


def shifted_window_mean(scores: torch.Tensor, width: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Eq. 13: ``Σ_{k=-⌊W_s/2⌋+γ}^{⌊W_s/2⌋+γ} Ê[j + k] / W_s`` per head, ``(batch, heads, L)``.

    ``width``/``shift`` are ``(batch, heads)``. Terms outside ``[0, L)`` count as 0 and the divisor is
    always ``W_s`` (as printed; SnapKV's zero-padded avgpool does the same at the edges). Uses a float64
    prefix sum so a huge score (an attention sink) does not swamp its small neighbours.
    """
    if bool(((width == 1) & (shift == 0)).all()):  # one host read
        return scores
    length = scores.shape[-1]
    prefix = torch.nn.functional.pad(scores.double().cumsum(dim=-1), (1, 0))  # prefix[i] = Σ_{m<i}
    j = torch.arange(length, device=scores.device).view(1, 1, -1)
    half = (width // 2).unsqueeze(-1)
    lo = (j - half + shift.unsqueeze(-1)).clamp(0, length)
    hi = (j + half + shift.unsqueeze(-1) + 1).clamp(0, length)
    total = prefix.gather(-1, hi) - prefix.gather(-1, lo)
    return (total / width.unsqueeze(-1).double()).to(scores.dtype)


def adaptive_spatial_smoothing(
    smoothed: torch.Tensor,
    indicator: torch.Tensor,
    k: torch.Tensor,
    candidates: torch.Tensor,
    beta: float,
    query_valid: torch.Tensor | None = None,
    base: int = 1,
    rule: str = "max",
) -> torch.Tensor:
    """Adaptive window-based spatial smoothing (AWS, Eq. 10–13) of ``smoothed`` ``(batch, heads, L)``.

    ``base`` is the window width when nothing drifts (see :func:`adaptive_window`).

    ``D_front``/``D_rear`` (Eq. 10) average, over the real queries of the front/rear half of the window,
    each query's mean top-``k`` index of the *unsmoothed* ``indicator`` ``I_t`` (``2/(B·S_w) Σ_t Σ_B``:
    top-B per query, then the average). A window with fewer than two queries, or a half without a real
    query, has no ΔD: the scores get the centred ``base`` window.
    """
    if indicator.shape[2] // 2 == 0:
        return drift_window_mean(smoothed, None, beta, query_valid, base, rule)
    return drift_window_mean(smoothed, top_index_mean(indicator, k, candidates), beta, query_valid, base, rule)


def drift_window_mean(
    smoothed: torch.Tensor,
    per_query: torch.Tensor | None,
    beta: float,
    query_valid: torch.Tensor | None = None,
    base: int = 1,
    rule: str = "max",
) -> torch.Tensor:
    """Eq. 10–13 from each window query's mean top-``k`` index ``per_query`` ``(batch, heads, w)`` (Eq. 10's inner
    sum, :func:`top_index_mean`; None for a window of fewer than two queries, which has no ΔD):
    :func:`adaptive_spatial_smoothing` once that sum is known."""
    if per_query is None or per_query.shape[2] // 2 == 0:
        plain = torch.full(smoothed.shape[:2], base, dtype=torch.long, device=smoothed.device)
        return shifted_window_mean(smoothed, plain, torch.zeros_like(plain))
    w = per_query.shape[2]
    half = w // 2
    # in float64: sums of float32 indices are then exact in any order, so the native pass (reconstruction.c's
    # plan_windows) gets the same widths and shifts
    index = per_query.double()
    weight = torch.ones(per_query.shape[0], w, dtype=torch.float64, device=per_query.device)
    if query_valid is not None:
        weight = query_valid.to(torch.float64)
    weight = weight.unsqueeze(1)
    front_w, rear_w = weight[..., :half], weight[..., half:]
    d_front = (index[..., :half] * front_w).sum(-1) / front_w.sum(-1).clamp(min=1.0)
    d_rear = (index[..., half:] * rear_w).sum(-1) / rear_w.sum(-1).clamp(min=1.0)
    width, shift = adaptive_window(d_front, d_rear, beta, base, rule)
    defined = (front_w.sum(-1) > 0) & (rear_w.sum(-1) > 0)
    width = torch.where(defined, width, torch.full_like(width, base))
    shift = torch.where(defined, shift, torch.zeros_like(shift))
    return shifted_window_mean(smoothed, width, shift)
