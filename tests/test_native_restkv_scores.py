"""ReST-KV's window scores from one C pass (``kvsieve.native.restkv_scores``) against the PyTorch path they replace:
the indicator of Eq. 7 smoothed over the window (Eq. 9's EMA weights, or the mean) within float32 rounding of
:func:`~kvsieve.ops.reconstruction.restkv_indicator` followed by the window's weighted sum, and each window query's mean
top-``k`` index equal to :func:`~kvsieve.ops.smoothing.top_index_mean`'s; in a model, the restkv scorer's scores
within float32 rounding of the PyTorch path's and the same kept entries, on every architecture."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_ARCHS, build_model
from helpers import all_kept_positions, prompt
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import kvsieve
from kvsieve.native import restkv_scores
from kvsieve.native.restkv_scores import window_scores
from kvsieve.ops.reconstruction import EPS, restkv_indicator
from kvsieve.ops.smoothing import drift_window_mean, ema_weights, top_index_mean
from kvsieve.parts.scorers import restkv as restkv_scorer
from kvsieve.transformers_adapter import cache_kwargs

pytestmark = pytest.mark.skipif(not restkv_scores.vector_code(), reason="no AVX-512 nor AVX2 and FMA in this build")


def _inputs(batch, kv_heads, groups, w, length, dim, dtype, seed, projected=True):
    generator = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * groups
    # attention well below 1: where A → 1 the expansion o G oᵀ − 2 o G vᵀ + v G vᵀ cancels in both paths (documented
    # in kvsieve.ops.reconstruction.output_distances), and A / (1 − A) magnifies their different rounding
    logits = torch.randn(batch, q_heads, w, length, generator=generator)
    rows = logits.softmax(-1).contiguous()
    values = torch.randn(batch, length, kv_heads, dim, generator=generator).to(dtype).transpose(1, 2)
    outputs = torch.matmul(rows.view(batch, kv_heads, groups * w, length), values.float()).view(batch, q_heads, w, dim)
    gram = None
    if projected:
        factor = torch.randn(q_heads, dim, 2 * dim, generator=generator) / dim
        gram = (factor @ factor.transpose(1, 2)).contiguous()
    return rows, outputs.contiguous(), values, gram


def _reference(rows, outputs, values, gram, weights, budgets, prefix):
    indicator = restkv_indicator(rows, outputs, values, gram)  # (b, q_heads, w, L)
    smoothed = torch.einsum("t,bhtl->bhl", weights, indicator)
    smoothed[..., prefix:] = 0.0
    candidates = (torch.arange(rows.shape[-1]) < prefix).expand(rows.shape[0], rows.shape[1], -1)
    per_query = top_index_mean(indicator, budgets, candidates) if budgets is not None else None
    return smoothed, per_query


@settings(max_examples=40, deadline=None, derandomize=True)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), groups=st.integers(1, 3), w=st.integers(1, 40),
       length=st.integers(4, 300), dim=st.sampled_from([2, 7, 16, 32, 64, 96, 128, 256]), bf16=st.booleans(),
       projected=st.booleans(), ema=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_scores_and_drift_match_the_pytorch_path(batch, kv_heads, groups, w, length, dim, bf16, projected, ema, seed,
                                                  data):
    rows, outputs, values, gram = _inputs(batch, kv_heads, groups, w, length, dim,
                                          torch.bfloat16 if bf16 else torch.float32, seed, projected)
    prefix = data.draw(st.integers(0, length))
    budgets = torch.tensor(data.draw(st.lists(st.integers(0, length + 2), min_size=batch * kv_heads * groups,
                                              max_size=batch * kv_heads * groups))).view(batch, -1)
    weights = (ema_weights(torch.ones(1, w, dtype=torch.bool), 0.3)[0] if ema
               else torch.full((w,), 1.0 / w, dtype=torch.float64)).float()
    result = window_scores(rows, outputs, values, gram, weights, budgets, prefix, EPS)
    assert result is not None
    smoothed, per_query = result
    expected, expected_per_query = _reference(rows, outputs, values, gram, weights, budgets, prefix)
    torch.testing.assert_close(smoothed, expected, rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(per_query, expected_per_query, rtol=0, atol=0)
    if restkv_scores.computes_outputs(values):  # the window's outputs from the pass itself (AMX tiles)
        own, own_per_query = window_scores(rows, None, values, gram, weights, budgets, prefix, EPS)
        torch.testing.assert_close(own, expected, rtol=2e-5, atol=1e-7)
        torch.testing.assert_close(own_per_query, expected_per_query, rtol=0, atol=0)
    # the adaptive window applied by the pass: drift_window_mean's on the pass's own scores, bit for bit
    beta = data.draw(st.sampled_from([0.5, 3.0, 40.0, 2000.0]))
    base, rule = data.draw(st.sampled_from([1, 3, 5])), data.draw(st.sampled_from(["max", "sum"]))
    windowed, windowed_per_query = window_scores(rows, outputs, values, gram, weights, budgets, prefix, EPS,
                                                 (beta, base, rule))
    assert windowed_per_query.equal(per_query)
    assert windowed.equal(drift_window_mean(smoothed, per_query if w >= 2 else None, beta, None, base, rule))


def test_ties_at_the_kth_value_take_the_lowest_indices():
    """Equal indicators (the same attention and value at several entries): the mean counts the lowest of them."""
    rows = torch.full((1, 1, 2, 10), 0.1)
    rows[0, 0, :, 7] = 0.3  # entry 7 above the rest, which all tie
    outputs = torch.zeros(1, 1, 2, 4)
    values = torch.ones(1, 1, 10, 4)
    weights = torch.tensor([0.5, 0.5])
    _, per_query = window_scores(rows, outputs, values, None, weights, torch.tensor([[3]]), 10, EPS)
    assert per_query.equal(torch.full((1, 1, 2), (7 + 0 + 1) / 3))


def _native_against_pytorch(model, ids, params, monkeypatch, seen=lambda step: None):
    """One prompt through ``restkv`` with the pass and once without it: whether each layer took the pass, the relative
    difference of its scores from the PyTorch path's, and the positions each run kept. ``seen(step)`` is called at
    each layer's scoring."""
    taken, diffs = [], []
    original_raw = restkv_scorer.OutputReconstruction.raw

    def compared(self, step, nominal):
        seen(step)
        rows = step.window_rows(max(self.window, 1))
        native = self._native_raw(step, rows, step.view.positions < step.query_positions[-rows.shape[2]], nominal)
        taken.append(native is not None)
        with monkeypatch.context() as patch:
            patch.setattr(restkv_scorer, "window_scores", lambda *args: None)
            reference = original_raw(self, step, nominal)
        if native is not None:
            diffs.append(float((native - reference).abs().max() / reference.abs().max().clamp(min=1e-30)))
        return original_raw(self, step, nominal)

    kept = []
    for native in (True, False):
        with monkeypatch.context() as patch:
            if native:
                patch.setattr(restkv_scorer.OutputReconstruction, "raw", compared)
            else:
                patch.setattr(restkv_scorer, "window_scores", lambda *args: None)
            cache = kvsieve.KVCache(model, "restkv", **params)
            with torch.inference_mode():
                model(ids, **cache_kwargs(model, cache))
            cache.flush()
            kept.append([positions.tolist() for *_, positions in all_kept_positions(cache)])
    return taken, diffs, kept


@pytest.mark.parametrize("levels", [3, 40, 100_000])
def test_the_top_k_of_long_rows_with_many_ties_is_top_index_means(levels):
    """Rows of 5000 entries whose attention takes only a few distinct values (ties by the thousand at the k-th value) or
    many: each window query's mean top-k index is exactly that of its k largest indicators, ties taken lowest index
    first (a stable descending sort; torch.topk may take any of the ties)."""
    generator = torch.Generator().manual_seed(levels)
    w, length, dim = 4, 5000, 32
    rows = (torch.randint(1, levels + 1, (1, 2, w, length), generator=generator).float() / (levels * length))
    values = torch.ones(1, 1, length, dim)  # o_t - v_j the same for every j: the indicator ranks as the attention
    outputs = torch.zeros(1, 2, w, dim)
    weights = torch.full((w,), 1.0 / w)
    order = restkv_indicator(rows, outputs, values, None).sort(dim=-1, descending=True, stable=True).indices
    for k in (1, 7, 256, 2500, 4999):
        budgets = torch.tensor([[k, k // 2 + 1]])
        _, per_query = window_scores(rows, outputs, values, None, weights, budgets, length, EPS)
        for head, top in enumerate((k, k // 2 + 1)):
            expected = order[0, head, :, :top].sum(-1).float() / top  # the integer sum rounded, divided: as the pass
            assert per_query[0, head].equal(expected)


@pytest.mark.skipif(not restkv_scores.computes_outputs(torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)),
                    reason="no AMX tiles here")
@pytest.mark.parametrize("params", [{"window": 8}, {"window": 8, "use_output_projection": False}, {"window": 1}])
def test_restkv_on_the_tiles_in_a_bf16_model_keeps_what_the_pytorch_path_keeps(params, monkeypatch):
    """A bf16 Llama with 32-wide heads takes the tiles' pass (the window's outputs computed there too): its scores are
    within float32 rounding of the PyTorch path's and the same entries are kept."""
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    outputs_given = []
    taken, diffs, kept = _native_against_pytorch(
        model, prompt(2, 300, seed=5), {"budget": 64, **params}, monkeypatch,
        lambda step: outputs_given.append(not restkv_scores.computes_outputs(step.view.values)))
    assert taken and all(taken) and not any(outputs_given)
    assert max(diffs) < 1e-5
    assert kept[0] == kept[1]


@pytest.mark.skipif(not restkv_scores.computes_outputs(torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)),
                    reason="no AMX tiles here")
def test_the_tiles_products_are_of_float32_accuracy():
    """Three bfloat16 parts of each float32 operand make the tiles' products float32's: every score within 1.5e-6
    (relative) of the vector pass's on the same numbers as float32 values, and within 5e-7 where the pass computes the
    window's outputs itself (two parts, 2^-18, were 3e-6 and 2e-6)."""
    worst_values, worst_outputs = 0.0, 0.0
    for seed in range(12):
        for batch, kv_heads, groups, w, length, dim, projected in [(1, 3, 3, 32, 1000, 64, True),
                                                                   (2, 2, 2, 5, 300, 32, True),
                                                                   (1, 1, 3, 40, 77, 128, False),
                                                                   (1, 2, 1, 17, 50, 96, True),
                                                                   (1, 1, 2, 128, 400, 256, True)]:  # the largest
            rows, outputs, values, gram = _inputs(batch, kv_heads, groups, w, length, dim, torch.bfloat16, seed,
                                                  projected)
            weights = torch.full((w,), 1.0 / w)
            tiles = window_scores(rows, outputs, values, gram, weights, None, length - w, EPS)[0]
            vectors = window_scores(rows, outputs, values.float(), gram, weights, None, length - w, EPS)[0]
            own = window_scores(rows, None, values, gram, weights, None, length - w, EPS)[0]
            scale = tiles.abs().clamp(min=1e-30)
            worst_values = max(worst_values, float(((tiles - vectors).abs() / scale).max()))
            worst_outputs = max(worst_outputs, float(((tiles - own).abs() / scale).max()))
    assert worst_values < 1.5e-6
    assert worst_outputs < 5e-7


def test_the_adaptive_window_is_drift_window_means_where_the_halves_drift_apart():
    """Early window queries attend to the start, late ones to the end: the halves' mean indices differ by far more
    than beta, so the pass's window is wide and shifted — as drift_window_mean's, bit for bit."""
    w, length = 8, 200
    logits = torch.zeros(1, 1, w, length)
    logits[0, 0, : w // 2, :20] = 6.0
    logits[0, 0, w // 2:, 150:170] = 6.0
    rows = logits.softmax(-1).contiguous()
    values = torch.randn(1, 1, length, 16, generator=torch.Generator().manual_seed(1))
    outputs = torch.matmul(rows, values).contiguous()
    weights, budgets = torch.full((w,), 1.0 / w), torch.tensor([[10]])
    smoothed, per_query = window_scores(rows, outputs, values, None, weights, budgets, length - w, EPS)
    for rule in ("max", "sum"):
        windowed, _ = window_scores(rows, outputs, values, None, weights, budgets, length - w, EPS, (20.0, 5, rule))
        expected = drift_window_mean(smoothed, per_query, 20.0, None, 5, rule)
        assert windowed.equal(expected)
        assert not windowed.equal(drift_window_mean(smoothed, None, 20.0, None, 5, rule))  # not the centred window


def test_what_it_does_not_take_is_declined():
    rows, outputs, values, gram = _inputs(1, 2, 2, 4, 30, 16, torch.float32, seed=0)
    weights = torch.full((4,), 0.25)
    budgets = torch.full((1, 4), 5)
    assert window_scores(rows, outputs, values, gram, weights, budgets, 20, EPS) is not None
    assert window_scores(rows, outputs, values.half(), gram, weights, budgets, 20, EPS) is None
    assert window_scores(rows.double(), outputs, values, gram, weights, budgets, 20, EPS) is None
    assert window_scores(rows, outputs, values, gram, weights, budgets, 31, EPS) is None  # prefix past the entries
    assert window_scores(rows, outputs, values, gram[:, :8], weights, budgets, 20, EPS) is None
    assert window_scores(rows, outputs, values, gram, weights[:3], budgets, 20, EPS) is None
    assert window_scores(rows.transpose(2, 3).contiguous().transpose(2, 3), outputs, values, gram, weights, budgets,
                         20, EPS) is None  # not contiguous
    assert window_scores(rows, outputs, values, gram, weights, None, 20, EPS, (2000.0, 5, "max")) is None  # no budgets
    for drift in ((0.0, 5, "max"), (2000.0, 0, "max"), (2000.0, 5, "median")):
        assert window_scores(rows, outputs, values, gram, weights, budgets, 20, EPS, drift) is None


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.parametrize("params", [{"window": 8}, {"window": 8, "use_ema": False, "use_output_projection": False},
                                    {"window": 8, "adaptive_smoothing": False}, {"window": 1}])
def test_restkv_in_a_model_keeps_what_the_pytorch_path_keeps(arch, params, monkeypatch):
    """Every layer that takes the pass scores within float32 rounding of the PyTorch path, and the same entries are
    kept; the pass is taken wherever a prompt compacts without padding."""
    taken, diffs, kept = _native_against_pytorch(build_model(arch), prompt(2, 90, seed=3), {"budget": 24, **params},
                                                 monkeypatch)
    assert taken and all(taken)
    assert max(diffs) < 1e-5
    assert kept[0] == kept[1]
