"""ReST-KV (An et al., 2026, arXiv:2605.08840): Eq. 7 against brute-force removal, Eq. 9 and Eq. 10–13 on hand-computed
cases, the policy's wiring on a synthetic layer step, and restkv / pyramid_restkv / ada_restkv on tiny
models."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import get_model
from helpers import all_kept_positions, decode_loop, generate, left_pad, managed_layers, prompt, reference_cache
from transformers import DynamicCache

import kvsieve
from kvsieve.cache.store import LayerStore
from kvsieve.core.step import LayerStep
from kvsieve.models.architectures import ArchitectureSpec, ModelInfo
from kvsieve.ops.reconstruction import output_gram, restkv_indicator, vatp_indicator
from kvsieve.ops.smoothing import (
    adaptive_spatial_smoothing,
    adaptive_window,
    ema_over_window,
    mean_over_window,
    shifted_window_mean,
    top_index_mean,
)
from kvsieve.parts.scorers.restkv import OutputReconstruction
from kvsieve.transformers_adapter import cache_kwargs

BATCH, Q_HEADS, KV_HEADS, D, HIDDEN = 2, 4, 2, 8, 12
GROUPS = Q_HEADS // KV_HEADS


def random_rows(generator: torch.Generator, w: int, n: int) -> torch.Tensor:
    """Float64 softmax rows ``(BATCH, Q_HEADS, w, n)``, causal-like (row t sees n - w + t + 1 keys)."""
    logits = torch.randn(BATCH, Q_HEADS, w, n, generator=generator, dtype=torch.float64) * 2
    visible = torch.arange(n).view(1, -1) <= (n - w + torch.arange(w)).view(-1, 1)
    return torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)


def brute_force_removal(rows: torch.Tensor, values: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``‖(o - o_without_j) W_O^h‖`` by deleting entry j and renormalising, one (b, h, t, j) at a time."""
    b_n, h_n, w, n = rows.shape
    out = torch.zeros_like(rows)
    for b in range(b_n):
        for h in range(h_n):
            v = values[b, h // GROUPS]
            w_o = None if weight is None else weight[:, h * D : (h + 1) * D].T  # d × hidden
            for t in range(w):
                a = rows[b, h, t]
                full = a @ v
                for j in range(n):
                    kept = a.clone()
                    kept[j] = 0
                    change = full - (kept / kept.sum()) @ v
                    out[b, h, t, j] = (change if w_o is None else change @ w_o).norm()
    return out


@pytest.mark.parametrize("with_projection", [True, False])
def test_indicator_equals_brute_force_removal(with_projection):
    generator = torch.Generator().manual_seed(0)
    w, n = 3, 9
    rows = random_rows(generator, w, n)
    values = torch.randn(BATCH, KV_HEADS, n, D, generator=generator, dtype=torch.float64)
    weight = torch.randn(HIDDEN, Q_HEADS * D, generator=generator, dtype=torch.float64)
    outputs = torch.matmul(rows.view(BATCH, KV_HEADS, GROUPS * w, n), values).view(BATCH, Q_HEADS, w, D)
    gram = output_gram(weight, Q_HEADS) if with_projection else None
    closed = restkv_indicator(rows, outputs, values, gram)
    assert closed.dtype == torch.float64
    expected = brute_force_removal(rows, values, weight if with_projection else None)
    torch.testing.assert_close(closed, expected, atol=1e-10, rtol=1e-9)


def test_vatp_indicator_is_attention_times_value_norm():
    generator = torch.Generator().manual_seed(1)
    rows = random_rows(generator, 2, 7)
    values = torch.randn(BATCH, KV_HEADS, 7, D, generator=generator, dtype=torch.float64)
    norms = values.norm(dim=-1).repeat_interleave(GROUPS, dim=1)
    torch.testing.assert_close(vatp_indicator(rows, values), rows * norms.unsqueeze(2), atol=0, rtol=1e-12)


def _ema_recursion(indicator: torch.Tensor, alpha: float, valid: torch.Tensor) -> torch.Tensor:
    """Eq. 9 step by step (the reference the unrolled weighted sum must equal)."""
    out = torch.zeros(indicator.shape[0], indicator.shape[1], indicator.shape[3], dtype=torch.float64)
    for b in range(indicator.shape[0]):
        started = False
        for t in range(indicator.shape[2]):
            if not valid[b, t]:
                continue
            current = indicator[b, :, t].double()
            out[b] = alpha * current + (1 - alpha) * out[b] if started else current
            started = True
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.9, 1.0])
def test_ema_weighted_sum_equals_the_recursion(alpha):
    """The unrolled EMA (one weighted sum) against the recursion, with padding in front, holes between real queries,
    a row without any real query and a window of one."""
    generator = torch.Generator().manual_seed(7)
    indicator = torch.rand(4, 3, 9, 11, generator=generator)
    valid = torch.rand(4, 9, generator=generator) > 0.3
    valid[0] = True
    valid[1, :4] = False
    valid[2] = False
    for given, mask in ((valid, valid), (None, torch.ones(4, 9, dtype=torch.bool))):
        got = ema_over_window(indicator, alpha, given)
        torch.testing.assert_close(got.double(), _ema_recursion(indicator, alpha, mask), atol=1e-6, rtol=1e-6)
    one = indicator[:, :, :1]
    torch.testing.assert_close(ema_over_window(one, alpha), one[:, :, 0])


def test_ema_hand_computed():
    a, b, c = 1.0, 10.0, 100.0
    indicator = torch.tensor([a, b, c]).view(1, 1, 3, 1)
    assert ema_over_window(indicator, 0.3).item() == pytest.approx(0.3 * c + 0.7 * (0.3 * b + 0.7 * a))
    # a padding query in front: the recursion starts at the first real query
    valid = torch.tensor([[False, True, True]])
    assert ema_over_window(indicator, 0.3, valid).item() == pytest.approx(0.3 * c + 0.7 * b)
    assert ema_over_window(indicator, 1.0).item() == pytest.approx(c)
    assert mean_over_window(indicator).item() == pytest.approx((a + b + c) / 3)
    assert mean_over_window(indicator, valid).item() == pytest.approx((b + c) / 2)


@pytest.mark.parametrize(
    ("d_front", "d_rear", "width", "shift"),
    [
        (5000.0, 1000.0, 5, 2),  # ΔD = 4000: ⌊2⌋ → W = 5, γ = 2
        (1000.0, 5000.0, 5, -2),  # ΔD = -4000: trunc(-2) (printed: ⌊-2⌋ + 1 = -1)
        (3500.0, 1000.0, 3, 1),  # ⌊1.25⌋
        (1000.0, 3500.0, 3, -1),  # ⌊-1.25⌋ + 1
        (1100.0, 1000.0, 1, 0),  # |ΔD| < β: W = 1, no shift
        (1000.0, 1100.0, 1, 0),  # ⌊-0.05⌋ + 1 = 0
        (1000.0, 1000.0, 1, 0),  # ΔD = 0: centred (Eq. 12 as printed would give ⌊0⌋ + 1 = 1)
        (1000.0, 3000.0, 3, -1),  # ΔD = -2000 exactly: trunc(-1) (printed: ⌊-1⌋ + 1 = 0)
    ],
)
def test_adaptive_window_eq_11_12(d_front, d_rear, width, shift):
    front, rear = torch.tensor([d_front]), torch.tensor([d_rear])
    for rule in ("sum", "max"):  # base 1: Eq. 11 as printed under both rules
        w, s = adaptive_window(front, rear, 2000, rule=rule)
        assert (int(w), int(s)) == (width, shift), rule
    # rule="sum" (kvsieve ≤ 0.1): a base kernel k widens the same way: W_s = k + 2⌊|ΔD|/β⌋, same shift.
    w5, s5 = adaptive_window(front, rear, 2000, base=5, rule="sum")
    assert (int(w5), int(s5)) == (width + 4, shift)
    # rule="max" (default, the authors' code): W_s = max(k, 2⌊|ΔD|/β⌋ + 1), same shift.
    w5, s5 = adaptive_window(front, rear, 2000, base=5, rule="max")
    assert (int(w5), int(s5)) == (max(5, width), shift)
    assert tuple(map(int, adaptive_window(front, rear, 2000, base=5))) == (int(w5), int(s5))  # the default


@pytest.mark.parametrize(
    ("d_front", "d_rear", "base", "width_max", "width_sum", "shift"),
    [
        (1000.0, 1000.0, 5, 5, 5, 0),  # ΔD = 0: both give the base kernel
        (2900.0, 1000.0, 5, 5, 5, 0),  # |ΔD| = 1900 < β: equal (⌊0.95⌋ = 0)
        (1000.0, 2999.0, 21, 21, 21, 0),  # |ΔD| = 1999 < β, RULER's k = 21: equal
        (5000.0, 1000.0, 5, 5, 9, 2),  # ΔD = 4000: max(5, 2·2 + 1) = 5 vs 5 + 4 = 9
        (1000.0, 9000.0, 5, 9, 13, -4),  # ΔD = -8000: max(5, 2·4 + 1) = 9 vs 5 + 8 = 13, trunc(-4)
        (13000.0, 1000.0, 5, 13, 17, 6),  # ΔD = 12000: max(5, 13) = 13 vs 17
        (7000.0, 1000.0, 21, 21, 27, 3),  # ΔD = 6000, k = 21: max(21, 7) = 21 vs 21 + 6 = 27
    ],
)
def test_adaptive_window_max_rule_hand_computed(d_front, d_rear, base, width_max, width_sum, shift):
    """``rule="max"``: ``W_s = max(k, 2⌊|ΔD|/β⌋ + 1)`` — equal to ``rule="sum"`` while ``|ΔD| < β``,
    narrower above; the shift does not depend on the rule."""
    front, rear = torch.tensor([d_front]), torch.tensor([d_rear])
    w_max, s_max = adaptive_window(front, rear, 2000, base=base, rule="max")
    w_sum, s_sum = adaptive_window(front, rear, 2000, base=base, rule="sum")
    assert (int(w_max), int(s_max)) == (width_max, shift)
    assert (int(w_sum), int(s_sum)) == (width_sum, shift)
    assert int(w_max) <= int(w_sum)
    assert (int(w_max) == int(w_sum)) == (abs(d_front - d_rear) < 2000)
    with pytest.raises(ValueError, match="rule"):
        adaptive_window(front, rear, 2000, base=base, rule="nope")


def test_shifted_window_mean_eq_13():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).view(1, 1, 5)
    out = shifted_window_mean(scores, torch.tensor([[3]]), torch.tensor([[1]]))
    # j → mean over [j, j + 2] (out-of-range terms are 0, divisor always W_s = 3)
    torch.testing.assert_close(out[0, 0], torch.tensor([6.0, 9.0, 12.0, 9.0, 5.0]) / 3)
    out = shifted_window_mean(scores, torch.tensor([[1]]), torch.tensor([[-1]]))
    torch.testing.assert_close(out[0, 0], torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]))
    out = shifted_window_mean(scores, torch.tensor([[1]]), torch.tensor([[0]]))
    torch.testing.assert_close(out, scores)


def test_shifted_window_mean_keeps_small_scores_next_to_a_sink():
    scores = torch.tensor([1e6, 1e-3, 2e-3, 3e-3]).view(1, 1, 4)
    out = shifted_window_mean(scores, torch.tensor([[1]]), torch.tensor([[1]]))
    torch.testing.assert_close(out[0, 0], torch.tensor([1e-3, 2e-3, 3e-3, 0.0]), rtol=1e-6, atol=0)


def test_top_index_mean_per_query():
    indicator = torch.tensor([[0.1, 5.0, 0.2, 4.0], [3.0, 0.0, 2.0, 1.0]]).view(1, 1, 2, 4)
    everything = torch.ones(1, 1, 4, dtype=torch.bool)
    out = top_index_mean(indicator, torch.tensor([[2]]), everything)
    torch.testing.assert_close(out[0, 0], torch.tensor([2.0, 1.0]))  # {1, 3} and {0, 2}
    prefix = torch.tensor([True, True, True, False]).view(1, 1, 4)
    out = top_index_mean(indicator, torch.tensor([[2]]), prefix)
    torch.testing.assert_close(out[0, 0], torch.tensor([1.5, 1.0]))  # {1, 2} and {0, 2}
    out = top_index_mean(indicator, torch.tensor([[9]]), prefix)  # k above the candidates: all of them
    torch.testing.assert_close(out[0, 0], torch.tensor([1.0, 1.0]))


@pytest.mark.parametrize("ragged", [False, True])
def test_top_index_mean_brute_force(ragged):
    generator = torch.Generator().manual_seed(9)
    b_n, h_n, w, n = 2, 3, 4, 12
    indicator = torch.rand(b_n, h_n, w, n, generator=generator)
    if ragged:  # per-head candidate sets (padding, ragged heads) and per-head k
        candidates = torch.rand(b_n, h_n, n, generator=generator) < 0.7
        k = torch.randint(1, 10, (b_n, h_n), generator=generator)
    else:  # the fast path: the same leading entries in every head, one k
        candidates = (torch.arange(n) < 9).expand(b_n, h_n, n)
        k = torch.full((b_n, h_n), 5)
    out = top_index_mean(indicator, k, candidates)
    for b in range(b_n):
        for h in range(h_n):
            allowed = candidates[b, h].nonzero().flatten().tolist()
            for t in range(w):
                ranked = sorted(allowed, key=lambda j: -float(indicator[b, h, t, j]))[: int(k[b, h])]
                assert out[b, h, t].item() == pytest.approx(sum(ranked) / len(ranked), rel=1e-6)


def test_adaptive_spatial_smoothing_hand_computed():
    # front queries peak at index 2, rear queries at index 5: D_front = 2, D_rear = 5, ΔD = -3;
    # with β = 1: W_s = 2·3 + 1 = 7, γ = trunc(-3) = -3, so j averages E[j - 6 .. j] over 7.
    n = 10
    indicator = torch.zeros(1, 1, 4, n)
    indicator[0, 0, :2, 2] = 1.0
    indicator[0, 0, 2:, 5] = 1.0
    smoothed = torch.arange(n, dtype=torch.float32).view(1, 1, n)
    candidates = torch.ones(1, 1, n, dtype=torch.bool)
    out = adaptive_spatial_smoothing(smoothed, indicator, torch.tensor([[1]]), candidates, beta=1.0)
    expected = torch.tensor([sum(m for m in range(j - 6, j + 1) if 0 <= m < n) / 7 for j in range(n)])
    torch.testing.assert_close(out[0, 0], expected)
    out = adaptive_spatial_smoothing(smoothed, indicator, torch.tensor([[1]]), candidates, beta=1.0, rule="sum")
    torch.testing.assert_close(out[0, 0], expected)  # base 1: the rules agree
    # β = 2000: |ΔD| < β, W_s = 1 and γ = trunc(-3/2000) = 0 — unchanged
    out = adaptive_spatial_smoothing(smoothed, indicator, torch.tensor([[1]]), candidates, beta=2000.0)
    torch.testing.assert_close(out, smoothed)
    # ... and with base kernel 5 it is a centred 5-wide mean (SnapKV's avgpool, zero padded).
    out = adaptive_spatial_smoothing(smoothed, indicator, torch.tensor([[1]]), candidates, beta=2000.0, base=5)
    expected = torch.tensor([sum(m for m in range(j - 2, j + 3) if 0 <= m < n) / 5 for j in range(n)])
    torch.testing.assert_close(out[0, 0], expected)
    # β = 1, base 5, rule="sum": W_s = 5 + 6 = 11, γ = -3: j averages E[j - 8 .. j + 2] over 11.
    out = adaptive_spatial_smoothing(
        smoothed, indicator, torch.tensor([[1]]), candidates, beta=1.0, base=5, rule="sum"
    )
    expected = torch.tensor([sum(m for m in range(j - 8, j + 3) if 0 <= m < n) / 11 for j in range(n)])
    torch.testing.assert_close(out[0, 0], expected)
    # β = 1, base 5, rule="max" (default): W_s = max(5, 2·3 + 1) = 7, γ = -3: E[j - 6 .. j] over 7.
    out = adaptive_spatial_smoothing(smoothed, indicator, torch.tensor([[1]]), candidates, beta=1.0, base=5)
    expected = torch.tensor([sum(m for m in range(j - 6, j + 1) if 0 <= m < n) / 7 for j in range(n)])
    torch.testing.assert_close(out[0, 0], expected)


# ---------------------------------------------------------------------------- policy on a synthetic step
N, WINDOW = 20, 5


def synthetic_step(seed: int) -> tuple[LayerStep, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill step with a real ``o_proj``; returns step, causal attention (float64), values, W."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, Q_HEADS, N, D, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, N, D, generator=generator)
    values = torch.randn(BATCH, KV_HEADS, N, D, generator=generator)
    o_proj = torch.nn.Linear(Q_HEADS * D, HIDDEN, bias=False)
    with torch.no_grad():
        o_proj.weight.copy_(torch.randn(HIDDEN, Q_HEADS * D, generator=generator))
    store = LayerStore(BATCH, KV_HEADS, D, torch.float32, torch.device("cpu"))
    store.append(keys, values, 0, None)
    info = ModelInfo(ArchitectureSpec(), 1, Q_HEADS, KV_HEADS, D, (None,))
    step = LayerStep(
        module=SimpleNamespace(o_proj=o_proj), layer_idx=0, info=info, query=query,
        first_position=0, query_valid=None, store=store, scaling=D**-0.5,
    )
    logits = query.double() @ keys.double().repeat_interleave(GROUPS, dim=1).transpose(-1, -2) * D**-0.5
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    attention = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    return step, attention, values.double(), o_proj.weight.detach().double()


def test_window_outputs_are_rows_times_values():
    step, attention, values, _ = synthetic_step(3)
    expected = attention[:, :, -WINDOW:] @ values.repeat_interleave(GROUPS, dim=1)
    out = step.window_outputs(WINDOW)
    assert out.shape == (BATCH, Q_HEADS, WINDOW, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert step.window_outputs(WINDOW) is out  # memoised


def reference_indicator(attention, values, weight) -> torch.Tensor:
    """Eq. 7 from its definition, materialising ``(o_t - v_j) W_O^h`` (float64, tiny sizes only)."""
    rows = attention[:, :, -WINDOW:]
    v = values.repeat_interleave(GROUPS, dim=1)
    diff = (rows @ v).unsqueeze(3) - v.unsqueeze(2)  # (b, h, w, n, d)
    w_o = weight.view(HIDDEN, Q_HEADS, D).permute(1, 2, 0)  # (h, d, hidden)
    projected = torch.einsum("bhtnd,hdk->bhtnk", diff, w_o)
    return rows / (1 - rows) * projected.norm(dim=-1)


def reference_scores(indicator: torch.Tensor, alpha: float) -> torch.Tensor:
    indicator = indicator.clone()
    indicator[..., N - WINDOW :] = 0.0  # only the prefix competes
    smoothed = indicator[:, :, 0]
    for t in range(1, WINDOW):
        smoothed = alpha * indicator[:, :, t] + (1 - alpha) * smoothed
    return smoothed.view(BATCH, KV_HEADS, GROUPS, N).mean(dim=2)


def nominal(budget: int) -> torch.Tensor:
    """The per-head budget ``(batch, kv_heads)`` the scorer receives (AWS's top-``B``)."""
    return torch.full((BATCH, KV_HEADS), budget)


def test_restkv_scores_follow_eq_7_and_9():
    step, attention, values, weight = synthetic_step(4)
    scorer = OutputReconstruction(window=WINDOW, adaptive_smoothing=False, kernel_size=1)
    assert scorer.order == "before" and scorer.width_rule == "max"  # the defaults
    expected = reference_scores(reference_indicator(attention, values, weight), 0.3)
    raw = scorer.raw(step, nominal(8))
    torch.testing.assert_close(raw.double(), expected, atol=1e-5, rtol=1e-4)
    scores = scorer.score(step, nominal(8))
    assert torch.isinf(scores[..., -WINDOW:]).all()
    torch.testing.assert_close(scores[..., :-WINDOW], raw[..., :-WINDOW])


@pytest.mark.parametrize("width_rule", ["max", "sum"])
def test_restkv_ablations_and_aws_wiring(width_rule):
    step, attention, values, weight = synthetic_step(5)
    indicator = reference_indicator(attention, values, weight)
    no_ema = OutputReconstruction(window=WINDOW, use_ema=False, adaptive_smoothing=False, kernel_size=1)
    masked = indicator.clone()
    masked[..., N - WINDOW :] = 0.0
    expected = masked.mean(dim=2).view(BATCH, KV_HEADS, GROUPS, N).mean(dim=2)
    torch.testing.assert_close(no_ema.raw(step, nominal(8)).double(), expected, atol=1e-5, rtol=1e-4)
    # AWS with a small β (so it really shifts) equals Eq. 10–13 applied to the reference indicator
    aws = OutputReconstruction(window=WINDOW, beta=1.5, width_rule=width_rule)
    ema = reference_scores(indicator, 0.3)  # group mean taken after smoothing below
    per_head = masked[:, :, 0]
    for t in range(1, WINDOW):
        per_head = 0.3 * masked[:, :, t] + 0.7 * per_head
    prefix = torch.arange(N).view(1, 1, -1).expand(BATCH, Q_HEADS, N) < N - WINDOW
    k = torch.full((BATCH, Q_HEADS), 6)
    smoothed = adaptive_spatial_smoothing(per_head, masked, k, prefix, 1.5, base=aws.kernel_size, rule=width_rule)
    expected = smoothed.view(BATCH, KV_HEADS, GROUPS, N).mean(dim=2)
    assert not torch.allclose(expected, ema)  # the small β did shift/widen some head
    torch.testing.assert_close(aws.raw(step, nominal(6)).double(), expected, atol=1e-5, rtol=1e-4)
    # without W_O: A/(1-A)·‖o - v‖
    plain = OutputReconstruction(window=WINDOW, use_output_projection=False, adaptive_smoothing=False, kernel_size=1)
    rows = attention[:, :, -WINDOW:]
    v = values.repeat_interleave(GROUPS, dim=1)
    distance = ((rows @ v).unsqueeze(3) - v.unsqueeze(2)).norm(dim=-1)
    expected = reference_scores(rows / (1 - rows) * distance, 0.3)
    torch.testing.assert_close(plain.raw(step, nominal(8)).double(), expected, atol=1e-5, rtol=1e-4)


def reference_after(attention, values, weight, alpha: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """``order="after"`` from its definition (float64), per query head ``(b, q_heads, N)``, window entries 0.

    ``a``: EMA over the window queries of their attention restricted to the prefix (not renormalised);
    ``o = Σ_{j ∈ prefix} a_j v_j`` with the query head's KV values; ``s_j = a_j/(1-a_j)·‖(o - v_j) W_O^h‖₂``.
    Also returns the window rows (ΔD's source in this mode).
    """
    rows = attention[:, :, -WINDOW:]
    prefix = torch.arange(N) < N - WINDOW
    restricted = rows * prefix.double()
    a = restricted[:, :, 0]
    for t in range(1, WINDOW):
        a = alpha * restricted[:, :, t] + (1 - alpha) * a
    scores = torch.zeros(BATCH, Q_HEADS, N, dtype=torch.float64)
    for b in range(BATCH):
        for h in range(Q_HEADS):
            v = values[b, h // GROUPS]
            w_o = weight[:, h * D : (h + 1) * D].T  # d × hidden
            o = sum(a[b, h, j] * v[j] for j in range(N) if prefix[j])
            for j in range(N):
                if prefix[j]:
                    scores[b, h, j] = a[b, h, j] / (1 - a[b, h, j]) * ((o - v[j]) @ w_o).norm()
    return scores, rows


def test_restkv_order_after_matches_its_definition():
    """``order="after"`` (the authors' ``metric_mode="after"``): EMA of the prefix attention first, then one
    reconstruction score against ``o = Σ_prefix a_j v_j``; reduced by the mean over each GQA group."""
    step, attention, values, weight = synthetic_step(6)
    per_head, rows = reference_after(attention, values, weight)
    scorer = OutputReconstruction(window=WINDOW, order="after", adaptive_smoothing=False, kernel_size=1)
    expected = per_head.view(BATCH, KV_HEADS, GROUPS, N).mean(dim=2)
    raw = scorer.raw(step, nominal(8))
    torch.testing.assert_close(raw.double(), expected, atol=1e-5, rtol=1e-4)
    assert (raw[..., N - WINDOW :] == 0).all()
    scores = scorer.score(step, nominal(8))
    assert torch.isinf(scores[..., -WINDOW:]).all()
    torch.testing.assert_close(scores[..., :-WINDOW], raw[..., :-WINDOW])
    before = OutputReconstruction(window=WINDOW, adaptive_smoothing=False, kernel_size=1).raw(step, nominal(8))
    assert not torch.allclose(raw, before, atol=1e-4)  # a different score, not a relabelling
    # with AWS (small β so it really shifts): the same smoothing, ΔD from each query's attention row
    aws = OutputReconstruction(window=WINDOW, order="after", beta=1.5)
    prefix = torch.arange(N).view(1, 1, -1).expand(BATCH, Q_HEADS, N) < N - WINDOW
    k = torch.full((BATCH, Q_HEADS), 6)
    smoothed = adaptive_spatial_smoothing(per_head, rows, k, prefix, 1.5, base=aws.kernel_size, rule="max")
    expected = smoothed.view(BATCH, KV_HEADS, GROUPS, N).mean(dim=2)
    torch.testing.assert_close(aws.raw(step, nominal(6)).double(), expected, atol=1e-5, rtol=1e-4)


def test_restkv_validation():
    for params in (
        {"alpha": 0.0}, {"alpha": 1.5}, {"beta": 0}, {"kernel_size": 4}, {"indicator": "nope"},
        {"use_ema": 1}, {"window": 9}, {"width_rule": "nope"}, {"order": "nope"},
        {"order": "after", "indicator": "vatp"},
    ):
        with pytest.raises(kvsieve.PolicyConfigError):
            kvsieve.make_policy("restkv", **{"budget": 8, "window": 4, **params})
    for params in ({}, {"width_rule": "sum"}, {"order": "after"}, {"window": 8}):
        kvsieve.make_policy("restkv", **{"budget": 8, "window": 4, **params})  # each case above alone is the error
    with pytest.raises(kvsieve.PolicyConfigError, match="pyramid_beta"):
        kvsieve.make_policy("pyramid_restkv", budget=8, window=4, pyramid_beta=0)
    with pytest.raises(kvsieve.PolicyConfigError, match="floor_alpha"):
        kvsieve.make_policy("ada_restkv", budget=8, window=4, floor_alpha=2.0)
    with pytest.raises(kvsieve.PolicyConfigError, match="schedule"):
        kvsieve.make_policy("restkv", budget=8, window=4, schedule="decode")
    assert {"restkv", "pyramid_restkv", "ada_restkv"} <= set(kvsieve.list_policies())


# ---------------------------------------------------------------------------- tiny models
PROMPT_LEN, BUDGET, WIN = 24, 8, 4
POLICIES = {
    "restkv": {},
    "restkv-vatp": {"indicator": "vatp"},
    "restkv-plain": {"use_output_projection": False, "use_ema": False, "adaptive_smoothing": False},
    "pyramid_restkv": {},
    "ada_restkv": {},
}


def make_cache(model, case: str, budget: int = BUDGET) -> kvsieve.KVCache:
    name = case.split("-")[0]
    return kvsieve.KVCache(model, name, budget=budget, window=WIN, **POLICIES[case])


def layer_budgets(cache: kvsieve.KVCache) -> list[int]:
    p = cache.policy
    window = p.scorer.protected_window()
    return [p.allocator.layer_budget(p.budget, i, cache.info.num_layers, window) for i in range(cache.info.num_layers)]


@pytest.mark.parametrize("case", list(POLICIES))
def test_tiny_models_budget_window_and_determinism(arch, model, case):
    ids = prompt(batch=2, length=PROMPT_LEN, seed=61)
    runs = []
    for _ in range(2):
        cache = make_cache(model, case)
        tokens, logits = decode_loop(model, cache, ids, steps=3)
        runs.append((tokens, torch.stack(logits), [p.tolist() for *_, p in all_kept_positions(cache)], cache))
    (tokens, logits, kept, cache), again = runs[0], runs[1]
    assert torch.equal(tokens, again[0]) and torch.equal(logits, again[1]) and kept == again[2]
    lengths = cache.head_lengths() - 3  # prefill-once: three decoded tokens appended afterwards
    budgets = layer_budgets(cache)
    for layer in managed_layers(cache):
        if case == "ada_restkv":
            assert (lengths[layer].sum(-1) == BUDGET * cache.info.num_kv_heads).all()
        else:
            assert (lengths[layer] == budgets[layer]).all(), (layer, lengths[layer].tolist())
    tail = list(range(PROMPT_LEN - WIN, PROMPT_LEN + 3))
    for layer, _, _, positions in all_kept_positions(cache):
        if layer in managed_layers(cache):
            assert positions[-len(tail) :].tolist() == tail


@pytest.mark.parametrize("case", ["restkv", "pyramid_restkv", "ada_restkv"])
def test_budget_ge_prompt_is_exact(arch, model, ref_model, case):
    ids = prompt(batch=2, length=PROMPT_LEN, seed=62)
    ref_seq, ref_logits = generate(ref_model, ids, DynamicCache(config=ref_model.config), 4)
    budget = 420 if case == "pyramid_restkv" else PROMPT_LEN  # pyramid: the last layer's budget must fit too
    cache = make_cache(model, case, budget=budget)
    with pytest.warns(UserWarning, match="nothing was compressed"):
        seq, logits = generate(model, ids, cache, 4)
    assert torch.equal(seq, ref_seq)
    assert torch.equal(logits[0], ref_logits[0])
    tol = 1e-5 if arch == "gemma3" else 0.0  # gemma3's sliding layers (see test_equivalence)
    for ours, ref in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, ref, atol=tol, rtol=0)
    _, prefill_logits = reference_cache(ref_model, ids)
    with pytest.warns(UserWarning, match="nothing was compressed"):
        logits = model(ids, **cache_kwargs(model, make_cache(model, case, budget=budget))).logits
    assert torch.equal(logits, prefill_logits)


def test_adakv_with_restkv_base_matches_ada_restkv():
    model = get_model("llama", "kv")
    ids = prompt(batch=2, length=PROMPT_LEN, seed=63)
    a = kvsieve.KVCache(model, "adakv", base="restkv", budget=BUDGET, window=WIN)
    b = kvsieve.KVCache(model, "ada_restkv", budget=BUDGET, window=WIN)
    model(ids, **cache_kwargs(model, a))
    model(ids, **cache_kwargs(model, b))
    assert [p.tolist() for *_, p in all_kept_positions(a)] == [p.tolist() for *_, p in all_kept_positions(b)]


def test_restkv_differs_from_snapkv():
    model = get_model("llama", "kv")
    """The value/W_O-aware indicator really changes the kept set on some head."""
    ids = prompt(batch=2, length=PROMPT_LEN, seed=64)
    kept = {}
    for name, params in (("restkv", {}), ("snapkv", {"kernel_size": 1})):
        cache = kvsieve.KVCache(model, name, budget=BUDGET, window=WIN, **params)
        model(ids, **cache_kwargs(model, cache))
        kept[name] = [p.tolist() for *_, p in all_kept_positions(cache)]
    assert kept["restkv"] != kept["snapkv"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("case", ["restkv", "ada_restkv"])
def test_left_padded_batch_equals_single_prompts(arch, case):
    model = get_model(arch, "kv")
    prompts = [prompt(length=n, seed=40 + n)[0] for n in (20, 11, 24)]
    ids, mask, pads = left_pad(prompts)
    batch = make_cache(model, case)
    batch_seq, _ = generate(model, ids, batch, 4, attention_mask=mask)
    for row, (p, pad) in enumerate(zip(prompts, pads, strict=True)):
        alone = make_cache(model, case)
        seq, _ = generate(model, p[None], alone, 4)
        assert torch.equal(seq[0, len(p) :], batch_seq[row, ids.shape[1] :])
        for layer, _, head, positions in all_kept_positions(alone):
            assert torch.equal(positions + pad, batch.kept_positions(layer, row, head)), (row, layer, head)


def test_the_output_gram_is_computed_once_per_weight_and_again_when_it_changes():
    """The W_O Gram matrices are cached per attention module: the same tensor while the weight stays, recomputed after
    an in-place update (version counter) and for a new weight tensor — never a stale Gram."""
    from kvsieve.parts.scorers.restkv import cached_output_gram

    module = torch.nn.Linear(12, 12, bias=False)
    first = cached_output_gram(module, module.weight.detach(), 3)
    assert first.equal(output_gram(module.weight.detach(), 3))
    assert cached_output_gram(module, module.weight.detach(), 3) is first
    with torch.no_grad():
        module.weight.mul_(2.0)  # in place: same storage, new version
    updated = cached_output_gram(module, module.weight.detach(), 3)
    assert updated.equal(output_gram(module.weight.detach(), 3)) and not updated.equal(first)
    replacement = torch.nn.Parameter(torch.randn(12, 12))  # a new tensor, at the same version as the former
    with torch.no_grad():
        while replacement._version < module.weight._version:
            replacement.add_(0.0)
    assert replacement._version == module.weight._version
    module.weight = replacement
    replaced = cached_output_gram(module, module.weight.detach(), 3)
    assert replaced.equal(output_gram(module.weight.detach(), 3)) and not replaced.equal(updated)
    assert cached_output_gram(module, module.weight.detach(), 4).shape == (4, 3, 3)  # another head count
    with torch.inference_mode():
        inference_weight = torch.randn(12, 12)
    assert cached_output_gram(module, inference_weight, 3).equal(output_gram(inference_weight, 3))
