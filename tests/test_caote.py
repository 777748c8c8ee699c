"""CAOTE / FastCAOTE (Goel et al., 2025, arXiv:2504.14051): Eq. 6–8 against brute-force removal, the meta-policy
wiring over h2o / tova / snapkv, inherited schedules, and the six policies on tiny models."""

from __future__ import annotations

import pytest
import torch
from conftest import get_model
from helpers import all_kept_positions, decode_loop, generate, left_pad, managed_layers, prompt
from test_scores import make_step, nominal, observe
from transformers import DynamicCache

import kvsieve
from kvsieve.ops.gqa import reduce_groups
from kvsieve.ops.reconstruction import caote_meta_scores, caote_scores
from kvsieve.parts.scorers.caote import Caote
from kvsieve.parts.scorers.h2o import ACCUMULATOR, AccumulatedAttention
from kvsieve.parts.scorers.snapkv import WindowAttention
from kvsieve.parts.scorers.tova import LastQueryAttention
from kvsieve.policies.presets import preset
from kvsieve.transformers_adapter import cache_kwargs

NAMES = ["h2o_caote", "tova_caote", "snapkv_caote", "h2o_fastcaote", "tova_fastcaote", "snapkv_fastcaote"]


def removal_change(weights: torch.Tensor, values: torch.Tensor, j: int) -> float:
    """``‖X - X̃_j‖`` with ``X = Σ_i w_i v_i`` and ``X̃_j`` the renormalised output without entry ``j``."""
    kept = weights.clone()
    kept[j] = 0
    return float((weights @ values - (kept / kept.sum()) @ values).norm())


def test_caote_eq6_equals_brute_force_removal():
    generator = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, n, d = 2, 4, 2, 9, 5
    attention = torch.softmax(torch.randn(batch, q_heads, n, generator=generator, dtype=torch.float64) * 2, -1)
    values = torch.randn(batch, kv_heads, n, d, generator=generator, dtype=torch.float64)
    scores = caote_scores(attention, values)
    assert scores.shape == (batch, q_heads, n) and scores.dtype == torch.float64
    for b in range(batch):
        for h in range(q_heads):
            for j in range(n):
                expected = removal_change(attention[b, h], values[b, h // 2], j)
                assert scores[b, h, j].item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_caote_meta_eq7_is_the_squared_form_of_the_removal_error():
    generator = torch.Generator().manual_seed(1)
    heads, n, d = 3, 8, 4
    base = torch.rand(1, heads, n, generator=generator, dtype=torch.float64) * 5  # H2O-like: Σ h > 1
    values = torch.randn(1, heads, n, d, generator=generator, dtype=torch.float64)
    scores = caote_meta_scores(base, values)
    for h in range(heads):
        weights = base[0, h] / base[0, h].sum()
        centre = weights @ values[0, h]
        for j in range(n):
            # Eq. 7 = h̃/(1-h̃)·‖X - v_j‖² = (eviction error under h̃) · ‖X - v_j‖
            expected = removal_change(weights, values[0, h], j) * float((centre - values[0, h, j]).norm())
            assert scores[0, h, j].item() == pytest.approx(expected, rel=1e-10)
    torch.testing.assert_close(caote_meta_scores(base * 7.0, values), scores, rtol=1e-12, atol=0)


def test_fastcaote_eq8_uses_the_plain_mean_value():
    generator = torch.Generator().manual_seed(2)
    heads, n, d = 2, 7, 4
    base = torch.rand(1, heads, n, generator=generator, dtype=torch.float64)
    values = torch.randn(1, heads, n, d, generator=generator, dtype=torch.float64)
    weights = base / base.sum(-1, keepdim=True)
    expected = weights / (1 - weights) * (values.mean(dim=2, keepdim=True) - values).norm(dim=-1)
    torch.testing.assert_close(caote_meta_scores(base, values, fast=True), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("fast", [False, True])
def test_meta_scores_ignore_padding_entries(fast):
    generator = torch.Generator().manual_seed(3)
    n, d, real = 8, 4, 5
    base = torch.rand(1, 1, n, generator=generator, dtype=torch.float64)
    values = torch.randn(1, 1, n, d, generator=generator, dtype=torch.float64)
    valid = (torch.arange(n) < real).view(1, 1, n)
    padded = caote_meta_scores(base, values, valid, fast=fast)
    alone = caote_meta_scores(base[..., :real], values[:, :, :real], fast=fast)
    torch.testing.assert_close(padded[..., :real], alone, rtol=1e-12, atol=0)
    assert (padded[..., real:] == 0).all()


def test_caote_scores_replace_base_scores_and_keep_base_protection():
    step, attention = make_step(7)
    values = step.view.values
    h2o = AccumulatedAttention()
    meta = kvsieve.make_policy("h2o_caote", budget=8).scorer
    assert meta == Caote(base=AccumulatedAttention(), fast=False)
    observe(meta, step)
    base = h2o.score(step, nominal(8))
    scores = meta.score(step, nominal(8))
    assert torch.equal(torch.isinf(scores), torch.isinf(base)) and torch.isinf(base).any()
    expected = caote_meta_scores(step.store.dense().extras[ACCUMULATOR], values)
    finite = ~torch.isinf(base)
    torch.testing.assert_close(scores[finite], expected[finite])
    kv_heads = step.info.num_kv_heads
    # tova's default score (heads="layer"): the last query's row averaged over every query head of the layer
    fast_scorer = kvsieve.make_policy("tova_fastcaote", budget=8).scorer
    assert fast_scorer == Caote(base=LastQueryAttention(heads="layer"), fast=True)
    layer_row = attention[:, :, -1].float().mean(dim=1, keepdim=True).expand(-1, kv_heads, -1)
    fast = fast_scorer.score(step, nominal(8))
    torch.testing.assert_close(fast, caote_meta_scores(layer_row, values, fast=True), rtol=1e-4, atol=1e-6)
    # ... and with heads="group" (kvsieve ≤ 0.1) the per-group average
    tova_row = reduce_groups(attention[:, :, -1].float(), kv_heads, "mean")
    fast = kvsieve.make_policy("tova_fastcaote", budget=8, heads="group").scorer.score(step, nominal(8))
    torch.testing.assert_close(fast, caote_meta_scores(tova_row, values, fast=True), rtol=1e-4, atol=1e-6)
    snap = kvsieve.make_policy("snapkv_caote", budget=8, window=4).scorer
    assert snap == Caote(base=WindowAttention(window=4), fast=False)
    snap_scores = snap.score(step, nominal(8))
    assert torch.isinf(snap_scores[..., -4:]).all()
    expected = caote_meta_scores(snap.base.raw(step, nominal(8)), values)
    torch.testing.assert_close(snap_scores[..., :-4], expected[..., :-4])
    torch.testing.assert_close(snap.raw(step, nominal(8)), expected)


@pytest.mark.parametrize("name", NAMES)
def test_schedules_and_fields_come_from_the_base(name):
    p = preset(name)
    assert kvsieve.list_policies()[name] is p
    assert isinstance(p.scorer, Caote) and p.scorer.fast is name.endswith("fastcaote")
    base_name = name.split("_")[0]
    base = preset(base_name)
    assert not isinstance(base.scorer, Caote) and p.scorer.base == base.scorer and p.allocator == base.allocator
    params = {"budget": 8, **({"window": 4} if base_name == "snapkv" else {})}
    policy, base_policy = kvsieve.make_policy(name, **params), kvsieve.make_policy(base_name, **params)
    assert isinstance(policy.scorer, Caote) and policy.scorer.fast is p.scorer.fast
    assert policy.scorer.base == base_policy.scorer
    assert policy.schedules() == base_policy.schedules()
    assert policy.scorer.schedules() == base_policy.scorer.schedules()
    assert policy.side() == base_policy.side()
    assert policy.scorer.needs() == base_policy.scorer.needs()
    assert policy.scorer.protected_window() == base_policy.scorer.protected_window()
    assert name in kvsieve.list_policies()


# ---------------------------------------------------------------------------- tiny models
PROMPT_LEN, BUDGET = 24, 8


def params_of(name: str, **extra: object) -> dict:
    return {"budget": BUDGET, **({"window": 4} if name.startswith("snapkv") else {}), **extra}


@pytest.mark.parametrize("name", NAMES)
def test_prefill_budget_and_determinism(arch, model, name):
    ids = prompt(batch=2, length=PROMPT_LEN, seed=71)
    runs = []
    for _ in range(2):
        cache = kvsieve.KVCache(model, name, **params_of(name))
        tokens, logits = decode_loop(model, cache, ids, steps=2)
        runs.append((tokens, torch.stack(logits), [p.tolist() for *_, p in all_kept_positions(cache)], cache))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]) and runs[0][2] == runs[1][2]
    cache = runs[0][3]
    managed = managed_layers(cache)
    assert (cache.head_lengths()[managed] == BUDGET + 2).all()
    if name.startswith("snapkv"):
        tail = list(range(PROMPT_LEN - 4, PROMPT_LEN + 2))
        for layer, _, _, positions in all_kept_positions(cache):
            if layer in managed:
                assert positions[-len(tail) :].tolist() == tail


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("snapkv")])
@pytest.mark.parametrize("buffer", [0, 2])
def test_decode_schedule_respects_budget_every_step(arch, model, name, buffer):
    cache = kvsieve.KVCache(model, name, **params_of(name, schedule="decode", buffer=buffer))
    managed: list[int] = []

    def check(step: int) -> None:
        managed[:] = managed_layers(cache)
        assert int(cache.head_lengths()[managed].max()) <= BUDGET + buffer, f"step {step}"

    decode_loop(model, cache, prompt(batch=2, length=PROMPT_LEN, seed=72), steps=5, after_step=check)


@pytest.mark.skipif("blockwise" not in AccumulatedAttention.SCHEDULES, reason="blockwise schedule not available")
@pytest.mark.parametrize("name", ["h2o_caote", "tova_fastcaote"])
def test_blockwise_schedule_is_inherited(model, name):
    cache = kvsieve.KVCache(model, name, budget=BUDGET, schedule="blockwise", block_size=6)
    decode_loop(model, cache, prompt(batch=2, length=PROMPT_LEN, seed=73), steps=2)
    assert int(cache.head_lengths()[managed_layers(cache)].max()) <= BUDGET


@pytest.mark.parametrize("name", ["h2o_caote", "tova_caote", "h2o_fastcaote"])
def test_budget_ge_total_is_exact(arch, model, ref_model, name):
    ids = prompt(batch=2, length=PROMPT_LEN, seed=74)
    ref_seq, ref_logits = generate(ref_model, ids, DynamicCache(config=ref_model.config), 4)
    cache = kvsieve.KVCache(model, name, budget=64, schedule="decode")
    seq, logits = generate(model, ids, cache, 4)
    assert torch.equal(seq, ref_seq)
    assert torch.equal(logits[0], ref_logits[0])
    tol = 1e-5 if arch == "gemma3" else 0.0  # gemma3's sliding layers (see test_equivalence)
    for ours, ref in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, ref, atol=tol, rtol=0)


def test_snapkv_caote_budget_ge_prompt_is_exact(model, ref_model):
    ids = prompt(batch=2, length=PROMPT_LEN, seed=75)
    ref_seq, _ = generate(ref_model, ids, DynamicCache(config=ref_model.config), 4)
    cache = kvsieve.KVCache(model, "snapkv_fastcaote", budget=PROMPT_LEN, window=4)
    with pytest.warns(UserWarning, match="nothing was compressed"):
        seq, _ = generate(model, ids, cache, 4)
    assert torch.equal(seq, ref_seq)


def test_caote_changes_the_kept_set():
    model = get_model("llama", "kv")
    ids = prompt(batch=2, length=PROMPT_LEN, seed=76)
    kept = {}
    for name in ("h2o", "h2o_caote", "h2o_fastcaote"):
        cache = kvsieve.KVCache(model, name, budget=BUDGET)
        model(ids, **cache_kwargs(model, cache))
        kept[name] = [p.tolist() for *_, p in all_kept_positions(cache)]
    assert kept["h2o_caote"] != kept["h2o"] and kept["h2o_fastcaote"] != kept["h2o"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(
    ("name", "params"),
    [("h2o_caote", {"schedule": "decode", "buffer": 2}), ("tova_fastcaote", {"schedule": "decode"}),
     ("snapkv_caote", {"window": 4})],
)
def test_left_padded_batch_equals_single_prompts(arch, name, params):
    model = get_model(arch, "kv")
    prompts = [prompt(length=n, seed=40 + n)[0] for n in (20, 11, 24)]
    ids, mask, pads = left_pad(prompts)
    batch = kvsieve.KVCache(model, name, budget=BUDGET, **params)
    batch_seq, _ = generate(model, ids, batch, 4, attention_mask=mask)
    for row, (p, pad) in enumerate(zip(prompts, pads, strict=True)):
        alone = kvsieve.KVCache(model, name, budget=BUDGET, **params)
        seq, _ = generate(model, p[None], alone, 4)
        assert torch.equal(seq[0, len(p) :], batch_seq[row, ids.shape[1] :])
        for layer, _, head, positions in all_kept_positions(alone):
            assert torch.equal(positions + pad, batch.kept_positions(layer, row, head)), (row, layer, head)
