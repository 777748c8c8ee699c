"""Quantization as a third action: KIVI (Liu et al., 2024, arXiv:2402.02750) and mixed precision at equal bytes.

The reference for ``kivi`` is the recipe computed by hand on the uncompressed cache's own keys and values:
the oldest entries of each head, keys per channel in groups of ``G`` tokens and values per token in groups
of ``value_group`` channels, float16 steps and minimums; the next token's logits are compared with the
model attending to exactly those dequantized entries through a plain ``DynamicCache``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from helpers import prompt
from test_quantize_ops import _kivi_by_hand
from transformers import DynamicCache

import kvsieve
from kvsieve.cache.store_layout import StoreLayout
from kvsieve.transformers_adapter import cache_kwargs

LENGTH, RESIDUAL, GROUP, VALUE_GROUP = 40, 8, 4, 8


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def _kivi(model, bits: int, **params) -> kvsieve.KVCache:
    return kvsieve.KVCache(model, "kivi", budget=RESIDUAL, bits=bits, group=GROUP, value_group=VALUE_GROUP,
                           buffer=GROUP - 1, **params)


def _reference(model, ids: torch.Tensor, bits: int) -> DynamicCache:
    """A DynamicCache holding the KIVI recipe's dequantized entries, computed by hand from the full cache."""
    full = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(model, full))
    quantized = LENGTH - RESIDUAL
    reference = DynamicCache(config=model.config)
    for index, layer in enumerate(full.layers):
        keys, values = layer.keys.clone(), layer.values.clone()
        for b in range(keys.shape[0]):
            for h in range(keys.shape[1]):
                for first in range(0, quantized, GROUP):
                    block = slice(first, min(first + GROUP, quantized))
                    keys[b, h, block] = _kivi_by_hand(keys[b, h, block], bits, block.stop - block.start, True)
                values[b, h, :quantized] = _kivi_by_hand(values[b, h, :quantized], bits, VALUE_GROUP, False)
        reference.update(keys, values, index)
    return reference


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_reproduces_the_recipe_computed_by_hand(model, bits):
    ids = prompt(length=LENGTH)
    cache = _kivi(model, bits)
    model(ids, **cache_kwargs(model, cache))
    cache.flush()  # a prompt's plan waits for the prompt to end; inspection applies it
    reference = _reference(model, ids, bits)
    for layer in range(len(cache.layers)):
        store = cache.layers[layer].store
        assert store.lengths().flatten().tolist() == [LENGTH] * store.lengths().numel()  # nothing evicted
        assert store.full_lengths().flatten().tolist() == [RESIDUAL] * store.lengths().numel()
        view = store.dense()
        torch.testing.assert_close(view.keys, reference.layers[layer].keys, rtol=0, atol=0)
        torch.testing.assert_close(view.values, reference.layers[layer].values, rtol=0, atol=0)
        assert torch.equal(view.positions[0, 0], torch.arange(LENGTH))
    token = prompt(length=1, seed=5)
    got = model(token, **cache_kwargs(model, cache)).logits
    expected = model(token, **cache_kwargs(model, reference)).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kivi_streams_whole_groups_while_decoding(model):
    ids = prompt(length=LENGTH)
    cache = _kivi(model, 2)
    out = model.generate(ids, max_new_tokens=13, do_sample=False, **cache_kwargs(model, cache))
    assert out.shape[1] == LENGTH + 13
    held = LENGTH + 12  # the last generated token is never fed back
    for layer in cache.layers:
        assert layer.store.lengths().flatten().tolist() == [held] * layer.store.lengths().numel()
        full = layer.store.full_lengths()
        assert bool((full >= RESIDUAL).all()) and bool((full < RESIDUAL + GROUP).all())
        assert bool((layer.store.tiers[0].counts % GROUP == 0).all())  # only whole groups were formed


def test_kivi_holds_fewer_bytes_than_the_full_cache(model):
    ids = prompt(length=LENGTH)
    full = kvsieve.KVCache(model, "full")
    model(ids, **cache_kwargs(model, full))
    cache = _kivi(model, 2)
    model(ids, **cache_kwargs(model, cache))
    quantized = (LENGTH - RESIDUAL) / LENGTH
    # 2-bit codes (1/8 of float32 per number... of the model's float32) plus float16 steps and minimums
    assert cache.kv_nbytes() < full.kv_nbytes() * (1 - quantized * 0.6)


def test_mixed_precision_spends_the_bytes_of_budget_entries(model):
    ids = prompt(length=96)
    budget = 40
    evict = kvsieve.KVCache(model, "restkv", budget=budget, window=8)
    model(ids, **cache_kwargs(model, evict))
    mixed = kvsieve.KVCache(model, "mixed", budget=budget, window=8, group=GROUP, value_group=VALUE_GROUP)
    model(ids, **cache_kwargs(model, mixed))
    assert mixed.kv_nbytes() <= evict.kv_nbytes()  # equal bytes: whole groups only
    for layer in mixed.layers:
        held, full = layer.store.lengths(), layer.store.full_lengths()
        assert bool((full == budget // 2).all())  # half the bytes in full precision
        assert bool((held > budget).all())  # more entries than eviction keeps
    for head in range(2):  # the full-precision entries are the best-scored ones, which eviction keeps too
        evicted_kept = set(evict.kept_positions(1, 0, head).tolist())
        full_view = StoreLayout.dense(mixed.layers[1].store)  # the full-precision tier alone
        full_kept = set(full_view.positions[0, head].tolist())
        assert len(full_kept) == budget // 2 and full_kept <= evicted_kept
    out = model.generate(ids, max_new_tokens=4, do_sample=False, **cache_kwargs(model, mixed))
    assert out.shape[1] == 100


def test_any_scorer_composes_with_the_quantize_action(model):
    ids = prompt(length=48)
    cache = kvsieve.KVCache(model, "snapkv", budget=16, window=4, action="quantize", bits=4, low_share=0.25,
                            group=GROUP, value_group=VALUE_GROUP, allocator="adaptive")
    model(ids, **cache_kwargs(model, cache))
    cache.flush()
    assert all(layer.store.tiers and not layer.store.tiers[0].empty for layer in cache.layers)


def test_budget_bytes_is_a_budget_in_full_entries(model):
    head_dim, element = 16, 4  # the tiny Llama in float32
    cache = kvsieve.KVCache(model, "snapkv", budget_bytes=32 * 2 * head_dim * element, window=4)
    assert cache.policy.budget == 32
    with pytest.raises(kvsieve.PolicyConfigError, match="budget_bytes"):
        kvsieve.KVCache(model, "snapkv", budget_bytes=0)
    with pytest.raises(kvsieve.PolicyConfigError, match="either budget_bytes or budget"):
        kvsieve.KVCache(model, "snapkv", budget_bytes=4096, budget=8)


@pytest.mark.parametrize(
    ("params", "mentions"),
    [
        ({"action": "quantize", "bits": 3}, "bits must be one of"),
        ({"action": "quantize", "low_share": 1.5}, "low_share"),
    ],
)
def test_bad_combinations_are_refused_before_any_work(model, params, mentions):
    with pytest.raises(kvsieve.PolicyConfigError, match=mentions):
        kvsieve.KVCache(model, "snapkv", budget=16, **params)


def test_value_group_must_divide_the_head_size(model):
    with pytest.raises(kvsieve.PolicyConfigError, match="value_group must divide"):
        kvsieve.KVCache(model, "kivi", budget=8, value_group=5)


def test_inspection_sees_every_tier(model):
    ids = prompt(length=LENGTH)
    cache = _kivi(model, 2)
    model(ids, **cache_kwargs(model, cache))
    assert cache.kept_positions(0, 0, 1).tolist() == list(range(LENGTH))
    keys, values = cache.kept_entries(0, 0, 1)
    assert keys.shape == (LENGTH, 16) and values.shape == (LENGTH, 16)


def test_several_tiers_take_the_next_best_entries_in_decreasing_precision(model):
    ids = prompt(length=96)
    budget = 40
    evict = kvsieve.KVCache(model, "restkv", budget=budget, window=8)
    model(ids, **cache_kwargs(model, evict))
    tiers = kvsieve.KVCache(model, "mixed", budget=budget, window=8, bits=(4, 2), low_share=(0.25, 0.25),
                            group=GROUP, value_group=VALUE_GROUP)
    model(ids, **cache_kwargs(model, tiers))
    assert tiers.kv_nbytes() <= evict.kv_nbytes()
    for layer in tiers.layers:
        store = layer.store
        assert [tier.bits for tier in store.tiers] == [4, 2]
        assert all(not tier.empty for tier in store.tiers)
        assert bool((store.full_lengths() == budget // 2).all())
        assert bool((store.tiers[1].lengths() > store.tiers[0].lengths()).all())  # 2-bit entries are cheaper


@pytest.mark.parametrize(
    ("params", "mentions"),
    [
        ({"bits": (2, 4), "low_share": (0.2, 0.2)}, "decreasing order"),
        ({"bits": (4, 2), "low_share": 0.5}, "one low_share per tier"),
        ({"bits": (4, 2), "low_share": (0.6, 0.6)}, "sum to at most 1"),
        ({"bits": (4, 2)}, "need a low_share"),
    ],
)
def test_bad_tiers_are_refused(params, mentions):
    with pytest.raises(kvsieve.PolicyConfigError, match=mentions):
        kvsieve.make_policy("snapkv", budget=16, action="quantize", **params)


def test_kivi_under_every_step_compaction_leaves_no_new_empty_slots(model):
    """KIVI (``low_share=None``) only moves whole groups out of its residual and never evicts a quantized entry, so
    the empty slots of its quantized groups (the prompt's last, partial group per head) do not grow while it
    decodes."""
    cache = kvsieve.KVCache(model, "kivi", budget=16)
    ids = prompt(length=100)

    def empty_slots() -> int:
        return sum(int((~tier.valid).sum()) for layer in cache.layers for tier in layer.store.tiers)

    with torch.no_grad():
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        out = model(token, **cache_kwargs(model, cache), use_cache=True)  # the prompt's compaction runs here
        after_prompt = empty_slots()
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(70):
            out = model(token, **cache_kwargs(model, cache), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
    assert empty_slots() == after_prompt
    assert sum(int(tier.valid.sum()) for layer in cache.layers for tier in layer.store.tiers) > 0


def _head_bytes(store) -> torch.Tensor:
    """Key/value bytes per (batch item, KV head): full-precision entries plus the quantized groups held."""
    per_full = 2 * store.head_dim * store.keys.element_size()
    held = store.length * per_full
    for tier in store.tiers:
        held = held + tier.segment_kv_nbytes()
    return held


@pytest.mark.parametrize(("schedule", "params"), [
    ("decode", {"buffer": 0}), ("decode", {"buffer": 6}), ("blockwise", {"block_size": 16}),
    ("blockwise", {"block_size": 16, "buffer": 3}),
])
def test_mixed_precision_holds_its_byte_budget_under_every_schedule(model, schedule, params):
    """Group-aware planning: at every compaction a head holds at most the bytes of ``budget`` full entries (plus the
    schedule's buffer, as any decoding-time policy): quantized groups are counted whole, part-filled ones too.
    Without it these schedules held 1.4–2.1× the budget after a few hundred steps (each compaction opened new
    part-filled groups)."""
    from helpers import decode_loop

    budget = 24
    cache = kvsieve.KVCache(model, "mixed", scorer="tova", budget=budget, group=GROUP, value_group=VALUE_GROUP,
                            schedule=schedule, **params)  # tova: a score defined at decoding steps too
    per_full = 2 * 16 * 4  # the tiny Llama: head size 16, float32
    limit = (budget + params.get("buffer", 0)) * per_full
    quantized_while_decoding: list[int] = []
    first_seen: dict[tuple[int, int, int], torch.Tensor] = {}

    def check(step: int) -> None:
        if step == 0 and schedule == "decode":
            return  # the prompt's compaction runs at the first decoding step
        for index, layer in enumerate(cache.layers):
            store = layer.store
            assert int(_head_bytes(store).max()) <= limit, (step, _head_bytes(store).tolist(), limit)
            for tier in store.tiers:  # a quantized entry keeps the codes it was first given (never re-quantized)
                keys, _, positions, valid = tier.dense()
                for b, h, j in valid.nonzero().tolist():
                    key = (index, b * store.heads + h, int(positions[b, h, j]))
                    seen = first_seen.setdefault(key, keys[b, h, j].clone())
                    assert torch.equal(seen, keys[b, h, j])
        quantized_while_decoding.append(len(first_seen))

    decode_loop(model, cache, prompt(batch=2, length=72, seed=5), steps=40, after_step=check)
    assert quantized_while_decoding[-1] > quantized_while_decoding[1]  # decoding quantized new entries too
    assert all(int(layer.store.full_lengths().max()) < budget for layer in cache.layers)


def test_scorers_with_side_data_keep_it_for_quantized_entries(model):
    """H2O's accumulated attention under mixed precision: a quantized entry keeps its accumulator (moved with it)
    and keeps accumulating while decoding, as an entry in the model dtype does."""
    from helpers import decode_loop

    from kvsieve.parts.scorers.h2o import ACCUMULATOR

    cache = kvsieve.KVCache(model, "h2o", budget=24, action="quantize", bits=4, low_share=0.5, group=GROUP,
                            value_group=VALUE_GROUP, schedule="decode", buffer=3)
    seen: list[dict[tuple[int, int, int], float]] = []

    def check(step: int) -> None:
        if step == 0:
            return
        store = cache.layers[1].store
        assert store.tiered
        view = store.dense()
        valid = view.valid if view.valid is not None else torch.ones(view.positions.shape, dtype=torch.bool)
        _, _, tier_positions, tier_valid = store.tiers[0].dense()
        quantized = {(b, h, int(tier_positions[b, h, j])) for b, h, j in tier_valid.nonzero().tolist()}
        acc = {}
        for b, h, j in valid.nonzero().tolist():
            position = int(view.positions[b, h, j])
            if (b, h, position) in quantized:
                acc[(b, h, position)] = float(view.extras[ACCUMULATOR][b, h, j])
        seen.append(acc)

    decode_loop(model, cache, prompt(batch=1, length=64, seed=8), steps=12, after_step=check)
    grew = [key for key in seen[0] if key in seen[-1] and seen[-1][key] > seen[0][key]]
    assert seen[0] and all(value > 0 for value in seen[0].values())  # moved with their accumulated attention
    assert grew  # and accumulating while quantized


@pytest.mark.parametrize("policy", ["tova", "dbtrimkv"])
def test_a_global_budget_composes_with_mixed_precision(model, policy):
    """One byte budget over every layer and head (a global allocator), mixed precision, decoding: each row holds
    at most the bytes of ``budget`` full entries per head over all its heads (plus the schedule's buffer)."""
    from helpers import decode_loop, with_test_gates

    budget, buffer = 20, 2
    params = with_test_gates(model, policy, {
        "budget": budget, "allocator": "global", "action": "quantize", "bits": 4, "low_share": 0.5, "group": GROUP,
        "value_group": VALUE_GROUP, "schedule": "decode", "buffer": buffer})
    cache = kvsieve.KVCache(model, policy, **params)
    per_full = 2 * 16 * 4
    totals: list[int] = []

    def check(step: int) -> None:
        if step == 0:
            return
        stores = [layer.store for layer in cache.layers]
        held = sum(_head_bytes(store).view(store.batch, store.heads).sum(dim=1) for store in stores)
        slots = sum(store.heads for store in stores)
        assert int(held.max()) <= (budget + buffer) * slots * per_full, (step, held.tolist())
        totals.append(int(sum(int(store.tiered) for store in stores)))

    decode_loop(model, cache, prompt(batch=2, length=64, seed=9), steps=10, after_step=check)
    assert max(totals) > 0  # some layer holds quantized entries


def test_quantized_entries_accumulate_exactly_their_own_attention(model, monkeypatch):
    """Every decoding step adds to each held entry — in the model dtype or quantized — exactly the attention the
    step's query paid it (the update H2O computed over the combined view, routed by the entry's position): the
    accumulator read back after the step is the one before plus that entry's own share, for every entry that
    stayed, across compactions that quantize, move and evict entries."""
    from helpers import decode_loop

    from kvsieve.parts.scorers.h2o import ACCUMULATOR, AccumulatedAttention

    cache = kvsieve.KVCache(model, "h2o", budget=24, action="quantize", bits=4, low_share=0.5, group=GROUP,
                            value_group=VALUE_GROUP, schedule="decode", buffer=3)
    updates: dict[int, dict[tuple[int, int, int], float]] = {}
    original = AccumulatedAttention.observe

    def observing(self, step):
        out = original(self, step)
        view = step.view
        valid = view.valid if view.valid is not None else torch.ones(view.positions.shape, dtype=torch.bool)
        if step.is_decoding:
            updates[step.layer_idx] = {(b, h, int(view.positions[b, h, j])): float(out[ACCUMULATOR][b, h, j])
                                       for b, h, j in valid.nonzero().tolist()}
        return out

    monkeypatch.setattr(AccumulatedAttention, "observe", observing)

    def held(layer: int) -> dict[tuple[int, int, int], float]:
        view = cache.layers[layer].store.dense()
        valid = view.valid if view.valid is not None else torch.ones(view.positions.shape, dtype=torch.bool)
        return {(b, h, int(view.positions[b, h, j])): float(view.extras[ACCUMULATOR][b, h, j])
                for b, h, j in valid.nonzero().tolist()}

    before: dict[int, dict[tuple[int, int, int], float]] = {}
    checked = {"quantized": 0, "full": 0}

    def check(step: int) -> None:
        for layer in range(len(cache.layers)):
            after = held(layer)
            if step >= 2:  # the prompt's compaction ran at step 1
                store = cache.layers[layer].store
                quantized = set()
                for tier in store.tiers:
                    _, _, positions, valid = tier.dense()
                    quantized |= {(b, h, int(positions[b, h, j])) for b, h, j in valid.nonzero().tolist()}
                for key, value in after.items():
                    expected = before[layer].get(key, 0.0) + updates[layer][key]
                    assert value == pytest.approx(expected, rel=1e-5, abs=1e-6), (step, layer, key)
                    checked["quantized" if key in quantized else "full"] += 1
            before[layer] = after

    decode_loop(model, cache, prompt(batch=2, length=64, seed=8), steps=14, after_step=check)
    assert checked["quantized"] > 100 and checked["full"] > 100
