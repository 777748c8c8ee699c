"""KeyDiff, Expected Attention and CAKE against re-derivations of their public reference code.

Each test runs plain transformers (``DynamicCache``) on a tiny random model, captures every layer's
attention input and cache, computes the reference score exactly as the public code does (kvpress's
``KeyDiffPress`` and ``ExpectedAttentionPress``: pre-RoPE queries re-projected through ``q_proj``, an explicit
averaged rotation matrix; CAKE's ``modify_llama.py`` and ``adjust_budgets``: eager window attention, the
entropy / variance preference, the budget adjustment), and compares the entries kvsieve keeps, per layer
and KV head, with the reference's top-k. kvsieve computes the same quantities another way (un-rotated
post-RoPE queries, ``R̄`` applied as ``mean cos`` / ``mean sin``, one total per batch row), so agreement of
the kept sets is the fidelity check.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import build_model
from helpers import prompt
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

import kvsieve
from kvsieve.core.part import PolicyConfigError
from kvsieve.ops.rope import rotary_table
from kvsieve.parts.allocators.cake import cascade_budgets
from kvsieve.parts.scorers.expected_attention import apply_rotation, averaged_rotation, query_statistics
from kvsieve.transformers_adapter import cache_kwargs

LENGTH, BUDGET = 64, 20


def run_reference(model, ids):
    """Plain transformers prefill: per layer the attention input ``h``, keys and values (post-RoPE)."""
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: inputs.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        cache = DynamicCache(config=model.config)
        model(ids, **cache_kwargs(model, cache))
    finally:
        for hook in hooks:
            hook.remove()
    return [(inputs[i], cache.layers[i].keys, cache.layers[i].values) for i in range(len(model.model.layers))]


def pre_rope_queries(module, hidden):
    """kvpress ``get_prerope_query_states`` for Llama-like (and Qwen3's ``q_norm``) attention."""
    batch, length, _ = hidden.shape
    heads, head_dim = module.config.num_attention_heads, module.head_dim
    queries = module.q_proj(hidden).view(batch, length, heads, head_dim)
    if hasattr(module, "q_norm"):
        queries = module.q_norm(queries)
    return queries.transpose(1, 2)


def compress(model, ids, name, **params):
    """kvsieve's cache after the prompt (the deferred plan applied by inspecting it)."""
    cache = kvsieve.KVCache(model, name, **params)
    model(ids, **cache_kwargs(model, cache))
    cache.head_lengths()
    return cache


def assert_kept(cache, reference_scores, budgets, rtol=0.0):
    """kvsieve's kept positions per (layer, head) are the reference's top ``budgets[layer]`` scores.

    ``rtol`` > 0 (a real model at float32, where two routes to the same score differ by rounding): an entry
    kept by one side only must score within ``rtol`` of the reference's k-th score (a near-tie).
    """
    for layer, scores in enumerate(reference_scores):
        for head in range(scores.shape[1]):
            row = scores[0, head].float()
            top = row.topk(budgets[layer])
            expected = set(top.indices.tolist())
            kept = set(cache.kept_positions(layer, 0, head).tolist())
            assert len(kept) == budgets[layer], (layer, head)
            if rtol == 0.0:
                assert kept == expected, (layer, head)
                continue
            boundary = float(top.values[-1])
            for position in kept ^ expected:
                assert math.isclose(float(row[position]), boundary, rel_tol=rtol), (layer, head, position)


# ------------------------------------------------------------------------------------------------- KeyDiff


def test_keydiff_keeps_the_reference_top_k():
    model = build_model("llama")
    ids = prompt(1, LENGTH, seed=3)
    reference = []
    for _, keys, _ in run_reference(model, ids):  # kvpress KeyDiffPress.score
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
        reference.append(-F.cosine_similarity(keys, anchor, dim=-1))
    cache = compress(model, ids, "keydiff", budget=BUDGET)
    assert_kept(cache, reference, [BUDGET] * len(reference))


def test_keydiff_ignores_padding_in_the_anchor():
    """A left-padded row keeps what it keeps alone: padding slots do not enter the mean key."""
    model = build_model("llama")
    alone = prompt(1, 40, seed=4)
    padded = torch.cat([torch.zeros(1, 7, dtype=torch.long), alone], dim=1)
    batch = torch.cat([padded, prompt(1, 47, seed=5)])
    mask = torch.ones_like(batch)
    mask[0, :7] = 0
    single = compress(model, alone, "keydiff", budget=12)
    cache = kvsieve.KVCache(model, "keydiff", budget=12)
    model(batch, attention_mask=mask, **cache_kwargs(model, cache))
    for layer in range(3):
        for head in range(2):
            assert (cache.kept_positions(layer, 0, head) - 7).tolist() == single.kept_positions(layer, 0, head).tolist()


# ---------------------------------------------------------------------------------------- Expected Attention


def kvpress_expected_attention(model, layer_idx, hidden, keys, values, n_future=512, n_sink=4):
    """kvpress ``ExpectedAttentionPress.score`` (use_covariance, use_vnorm, epsilon 0), sinks padded with max+1."""
    module = model.model.layers[layer_idx].self_attn
    q_len = hidden.shape[1]
    queries = pre_rope_queries(module, hidden[:, n_sink:])
    mu = queries.mean(dim=2, keepdim=True)
    centred = queries - mu
    cov = torch.einsum("bnsi,bnsj->bnij", centred, centred) / queries.shape[2]
    mu = mu.squeeze(2)
    positions = torch.arange(q_len, q_len + n_future).unsqueeze(0)
    cos, sin = model.model.rotary_emb(mu, positions)
    cos, sin = cos[0], sin[0]
    d = module.head_dim
    eye = torch.eye(d)
    swap = torch.zeros(d, d)
    swap[d // 2:, : d // 2], swap[: d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    rotation = (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * swap).mean(dim=0)
    mu, cov = mu @ rotation.T, rotation @ cov @ rotation.T
    keys, values = keys[:, :, n_sink:], values[:, :, n_sink:]
    batch, kv_heads, length, _ = keys.shape
    groups = module.config.num_attention_heads // kv_heads
    expanded = repeat_kv(keys, groups).transpose(2, 3)
    scores = torch.matmul(mu.unsqueeze(2), expanded).squeeze(2) / math.sqrt(d)
    scores = scores + torch.einsum("bhin,bhij,bhjn->bhn", expanded, cov, expanded) / d / 2
    scores = F.softmax(scores, dim=-1).view(batch, kv_heads, groups, length).mean(dim=2)
    scores = scores * values.norm(dim=-1)
    return F.pad(scores, (n_sink, 0), value=scores.max().item() + 1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_expected_attention_keeps_the_reference_top_k(arch):
    """Same kept entries as kvpress's formula on every layer and KV head (Qwen3: ``q_norm`` before RoPE,
    which kvsieve never re-applies: it un-rotates the queries the attention received)."""
    model = build_model(arch)
    ids = prompt(1, LENGTH, seed=6)
    reference = [kvpress_expected_attention(model, i, h, k, v) for i, (h, k, v) in
                 enumerate(run_reference(model, ids))]
    cache = compress(model, ids, "expected_attention", budget=BUDGET)
    assert_kept(cache, reference, [BUDGET] * len(reference))


def test_averaged_rotation_is_the_mean_rotation_matrix():
    """``x·mean(cos) + rotate_half(x)·mean(sin)`` equals the explicit ``mean_t R(t)`` applied to ``x``."""
    model = build_model("llama3")  # a scaled rope type
    table = rotary_table(model.config, 0)
    cos, sin = averaged_rotation(table, torch.tensor([5]), 40)
    x = torch.randn(1, 3, table.rotary_dim, generator=torch.Generator().manual_seed(0))
    full_cos, full_sin = model.model.rotary_emb(x, torch.arange(5, 45).unsqueeze(0))
    d = table.rotary_dim
    swap = torch.zeros(d, d)
    swap[d // 2:, : d // 2], swap[: d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    matrix = (full_cos[0].unsqueeze(1) * torch.eye(d) + full_sin[0].unsqueeze(1) * swap).mean(dim=0)
    torch.testing.assert_close(apply_rotation(x, cos, sin, d), x @ matrix.T, atol=1e-5, rtol=1e-5)


def test_expected_attention_keeps_the_sinks_and_refuses_sinks_over_budget():
    model = build_model("llama")
    cache = compress(model, prompt(1, LENGTH, seed=7), "expected_attention", budget=8)
    for layer in range(3):
        assert cache.kept_positions(layer, 0, 0)[:4].tolist() == [0, 1, 2, 3]
    with pytest.raises(PolicyConfigError, match="n_sink"):
        kvsieve.make_policy("expected_attention", budget=3)
    with pytest.raises(PolicyConfigError, match="n_future_positions"):
        kvsieve.make_policy("expected_attention", budget=8, n_future_positions=0)


# ---------------------------------------------------------------------------------------------------- CAKE


def reference_adjust_budgets(budget_list, total_budget, seq_len, layer_nums):
    """CAKE's ``utils.adjust_budgets``, transcribed."""
    budget_list = np.array(budget_list, dtype=int)
    excess = np.maximum(budget_list - seq_len, 0)
    budget_list = np.minimum(budget_list, seq_len)
    total_excess = np.sum(excess)
    if total_excess > 0:
        valid = budget_list < seq_len
        if np.sum(valid) > 0:
            budget_list[valid] += total_excess // np.sum(valid)
            budget_list[np.where(valid)[0][: total_excess % np.sum(valid)]] += 1
    diff = total_budget - np.sum(budget_list)
    if diff != 0:
        valid = budget_list < seq_len if diff > 0 else budget_list > 1
        if np.sum(valid) > 0:
            step, rest = abs(diff) // np.sum(valid), abs(diff) % np.sum(valid)
            sign = 1 if diff > 0 else -1
            budget_list[valid] += sign * step
            budget_list[np.where(valid)[0][:rest]] += sign
    return budget_list.tolist()


def cake_reference(model, captured, window, tau1, tau2, gamma):
    """CAKE's ``modify_llama.py`` prefill branch per layer: preference and indicator (eager window attention)."""
    preferences, indicators = [], []
    for i, (hidden, keys, _) in enumerate(captured):
        module = model.model.layers[i].self_attn
        queries = pre_rope_queries(module, hidden)
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        cos, sin = model.model.rotary_emb(hidden, positions)
        queries, _ = apply_rotary_pos_emb(queries, queries, cos, sin)
        groups = queries.shape[1] // keys.shape[1]
        logits = queries[..., -window:, :] @ repeat_kv(keys, groups).transpose(2, 3) / math.sqrt(module.head_dim)
        mask = torch.full((window, window), torch.finfo(logits.dtype).min).triu(1)
        logits[:, :, -window:, -window:] += mask
        attention = F.softmax(logits, dim=-1, dtype=torch.float32)
        prefix = attention[:, :, -window:, :-window]
        entropy = -torch.sum(prefix * torch.log(prefix + 1e-10))
        var = torch.var(prefix, dim=-2).sum()
        preferences.append(float(entropy ** (1 / tau1) * var ** (1 / tau2)))
        indicator = attention.mean(dim=-2) + gamma * attention.var(dim=-2)
        indicator = F.avg_pool1d(indicator[:, :, :-window], kernel_size=5, padding=2, stride=1)
        indicators.append(indicator.view(1, keys.shape[1], groups, -1).mean(dim=2))
    return preferences, indicators


@pytest.mark.parametrize(("tau1", "tau2"), [(1.0, 1.0), (1.6, 0.4)])
def test_cake_layer_budgets_and_kept_entries_match_the_reference(tau1, tau2):
    model = build_model("llama")
    window, budget = 8, BUDGET
    ids = prompt(1, LENGTH, seed=8)
    captured = run_reference(model, ids)
    preferences, indicators = cake_reference(model, captured, window, tau1, tau2, 200.0)
    layers = len(captured)
    total = (budget - window) * layers
    layer_budgets = reference_adjust_budgets([p / sum(preferences) * total for p in preferences], total,
                                             LENGTH - window, layers)
    cache = compress(model, ids, "cake", budget=budget, window=window, preference_window=window, tau1=tau1, tau2=tau2)
    lengths = cache.head_lengths()
    assert lengths[:, 0, :].tolist() == [[b + window] * 2 for b in layer_budgets]
    assert sum(layer_budgets) == total and len(set(layer_budgets)) > 1  # redistributed, same total
    for layer, indicator in enumerate(indicators):
        for head in range(2):
            expected = indicator[0, head].topk(layer_budgets[layer]).indices.sort().values.tolist()
            expected += list(range(LENGTH - window, LENGTH))
            assert cache.kept_positions(layer, 0, head).tolist() == expected, (layer, head)


def test_cake_allocator_composes_with_other_scorers():
    """``allocator="cake"`` gives the same layer budgets under any scorer (they come from the layer
    preference, not the scores); the model's total never exceeds ``L·H·B``."""
    model = build_model("llama")
    ids = prompt(1, LENGTH, seed=9)
    cake = compress(model, ids, "cake", budget=BUDGET, window=8, preference_window=8).head_lengths()
    for scorer in ("restkv", "snapkv"):
        lengths = compress(model, ids, scorer, budget=BUDGET, window=8, allocator="cake",
                           preference_window=8).head_lengths()
        assert lengths.tolist() == cake.tolist()
        assert int(lengths.sum()) <= 3 * 2 * BUDGET


@pytest.mark.parametrize("seed", range(20))
def test_cascade_budgets_is_the_reference_adjustment(seed):
    generator = np.random.default_rng(seed)
    layers = int(generator.integers(2, 9))
    preference = generator.random(layers) ** 3
    cap = int(generator.integers(5, 60))
    total = int(generator.integers(layers, layers * cap))
    expected = reference_adjust_budgets([p / preference.sum() * total for p in preference], total, cap, layers)
    got = cascade_budgets(torch.tensor(preference)[None], torch.tensor([total]), torch.full((1, layers), cap))
    assert got[0].tolist() == expected


def test_cake_refuses_bad_parameters():
    with pytest.raises(PolicyConfigError, match="tau1"):
        kvsieve.make_policy("cake", budget=64, tau1=0)
    with pytest.raises(PolicyConfigError, match="gamma"):
        kvsieve.make_policy("cake", budget=64, gamma=-1.0)
    with pytest.raises(PolicyConfigError, match="absolute budget"):
        kvsieve.make_policy("cake", ratio=0.5)
    with pytest.raises(PolicyConfigError, match="schedule"):
        kvsieve.make_policy("cake", budget=64, schedule="decode")


def test_expected_attention_refuses_a_length_dependent_rope_before_any_forward():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvsieve.ops.rope import UnsupportedRotaryError

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    model = LlamaForCausalLM(config).eval()
    with pytest.raises(UnsupportedRotaryError, match="dynamic"):
        kvsieve.KVCache(model, "expected_attention", budget=16)
    kvsieve.KVCache(model, "keydiff", budget=16)  # reads no rope: fine


def test_keydiff_and_expected_attention_compose_with_the_adaptive_allocator():
    """Head-wise budgets over KeyDiff's and Expected Attention's scores: each layer keeps ``H·B`` entries per row,
    split unevenly across its heads by the scores."""
    model = build_model("llama")
    ids = prompt(1, LENGTH, seed=10)
    for name in ("keydiff", "expected_attention"):
        lengths = compress(model, ids, name, budget=BUDGET, allocator="adaptive").head_lengths()
        assert lengths.sum(dim=-1).tolist() == [[2 * BUDGET]] * 3, name
        assert len({int(x) for x in lengths.flatten()}) > 1, name


@pytest.mark.parametrize("overwrite", [False, True])
def test_query_statistics_are_the_weighted_mean_and_biased_covariance(overwrite):
    """Mean and biased covariance over the used queries only (float64 reference, per row and head); a row with no
    used query gets zeros; without ``overwrite`` the queries are left as they were, with it they may be centred in
    place (Expected Attention passes the un-rotated buffer it owns)."""
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(3, 2, 40, 8, generator=generator) * 3 + 5
    use = torch.rand(3, 40, generator=generator) > 0.3
    use[2] = False
    original = queries.clone()
    mean, cov = query_statistics(queries, use, True, overwrite=overwrite)
    assert cov is not None
    for b in range(2):
        for h in range(2):
            used = original[b, h][use[b]].double()
            torch.testing.assert_close(mean[b, h].double(), used.mean(dim=0), atol=1e-5, rtol=1e-5)
            centred = used - used.mean(dim=0)
            torch.testing.assert_close(cov[b, h].double(), centred.T @ centred / used.shape[0], atol=1e-4, rtol=1e-5)
    assert not mean[2].any() and not cov[2].any()
    if not overwrite:
        assert torch.equal(queries, original)


@pytest.mark.parametrize("padded", [False, True])
def test_cake_window_mean_and_variance_are_the_weighted_formula_bit_for_bit(padded):
    """The window statistics skip the all-ones weights of an unpadded window and square in place: the same mean and
    unbiased variance, bit for bit, as the weighted formula (a padded window keeps its weights)."""
    from kvsieve.parts.allocators.cake import window_mean_var

    generator = torch.Generator().manual_seed(3)
    rows = torch.rand(2, 6, 8, 50, generator=generator).softmax(dim=-1)
    queries = torch.ones(2, 8, dtype=torch.bool)
    if padded:
        queries[0, :3] = False
    weights = queries.float()[:, None, :, None]
    count = weights.sum(dim=2)
    mean = (rows * weights).sum(dim=2) / count.clamp(min=1.0)
    variance = (((rows - mean.unsqueeze(2)) ** 2) * weights).sum(dim=2) / (count - 1.0).clamp(min=1.0)
    got_mean, got_variance = window_mean_var(rows, queries if padded else None)
    assert torch.equal(got_mean, mean) and torch.equal(got_variance, variance)
