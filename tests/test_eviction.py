"""Eviction keeps exact copies at their original positions, and decoding after eviction is right.

The strongest check here (``test_decoding_after_eviction_matches_cropped_reference``) rebuilds the
compressed cache by hand in plain transformers: a DynamicCache from the full prompt, gathered down to
the positions kvsieve kept, then decoded with explicit ``position_ids``. kvsieve must give the same
logits, which pins down both the attention over the kept entries and the RoPE positions of new tokens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import all_kept_positions, decode_loop, managed_layers, prompt, reference_cache, sliding_layers
from transformers import DynamicCache

import kvsieve
from kvsieve.transformers_adapter import cache_kwargs

PROMPT_LEN = 24

EVICTING = {
    "random": {"budget": 8, "window": 2},
    "streaming_llm": {"budget": 8},
    "h2o": {"budget": 8},
    "tova": {"budget": 8},
    "snapkv": {"budget": 8, "window": 4},
    "snapkv-ratio": {"ratio": 0.5, "window": 4},
    "pyramidkv": {"budget": 8, "window": 4},
    "adakv": {"budget": 8, "window": 4},
    "h2o-decode": {"budget": 8, "schedule": "decode", "buffer": 2},
}


def policy_name(case: str) -> str:
    return case.split("-")[0]


@pytest.mark.parametrize("case", list(EVICTING))
def test_kept_entries_are_exact_copies(arch, model, ref_model, case):
    """Every kept (key, value) is bit-identical to the original at ``kept_positions``."""
    ids = prompt(batch=2, length=PROMPT_LEN, seed=11)
    dyn, _ = reference_cache(ref_model, ids)
    full = kvsieve.KVCache(model, "full")
    model(ids, **cache_kwargs(model, full))
    cache = kvsieve.KVCache(model, policy_name(case), **EVICTING[case])
    model(ids, **cache_kwargs(model, cache))
    managed = managed_layers(cache)
    evicted = False
    for layer, b, h, positions in all_kept_positions(cache):
        keys, values = cache.kept_entries(layer, b, h)
        assert keys.shape == values.shape == (len(positions), cache.info.head_dim)
        if layer in managed:
            # originals straight from plain transformers
            assert torch.equal(keys, dyn.layers[layer].keys[b, h, positions])
            assert torch.equal(values, dyn.layers[layer].values[b, h, positions])
            evicted |= len(positions) < PROMPT_LEN
        else:
            # sliding layers: compare with the same slots of a `full` kvsieve run
            full_pos = full.kept_positions(layer, b, h)
            full_keys, full_values = full.kept_entries(layer, b, h)
            slot = torch.searchsorted(full_pos, positions)
            assert torch.equal(full_pos[slot], positions)
            assert torch.equal(keys, full_keys[slot]) and torch.equal(values, full_values[slot])
    assert evicted, "the case must really evict something"


@pytest.mark.parametrize("policy", ["h2o", "tova", "streaming_llm", "random"])
def test_kept_entries_exact_after_decode_schedule(model, policy):
    """With decoding-time eviction, layer-0 entries of generated tokens are exact copies too.

    Layer 0's keys depend only on the token and its position, so replaying the same tokens through a
    ``full`` cache reproduces them; deeper layers are compared on prompt positions only.
    """
    ids = prompt(batch=2, length=16, seed=12)
    cache = kvsieve.KVCache(model, policy, budget=8, schedule="decode", buffer=1)
    tokens, _ = decode_loop(model, cache, ids, steps=8)
    full = kvsieve.KVCache(model, "full")
    model(ids, **cache_kwargs(model, full))
    for i in range(tokens.shape[1]):
        model(tokens[:, i : i + 1], **cache_kwargs(model, full))
    assert full.get_seq_length() == cache.get_seq_length() == 16 + 8
    generated_seen = False
    for layer, b, h, positions in all_kept_positions(cache):
        keys, values = cache.kept_entries(layer, b, h)
        full_positions = full.kept_positions(layer, b, h)
        full_keys, full_values = full.kept_entries(layer, b, h)
        check = positions < 16 if layer > 0 else torch.ones_like(positions, dtype=torch.bool)
        generated_seen |= bool((positions >= 16).any()) and layer == 0
        slot = torch.searchsorted(full_positions, positions[check])
        assert torch.equal(full_positions[slot], positions[check])
        assert torch.equal(keys[check], full_keys[slot])
        assert torch.equal(values[check], full_values[slot])
    assert generated_seen


def test_positions_sorted_unique_in_range(arch, model):
    ids = prompt(batch=2, length=PROMPT_LEN, seed=13)
    for case, params in EVICTING.items():
        cache = kvsieve.KVCache(model, policy_name(case), **params)
        decode_loop(model, cache, ids, steps=5)
        seen = cache.get_seq_length()
        for _, _, _, positions in all_kept_positions(cache):
            assert positions.dtype == torch.long
            assert len(positions) > 0
            assert bool((positions[1:] > positions[:-1]).all()), f"{case}: unsorted/duplicate {positions}"
            assert int(positions[0]) >= 0 and int(positions[-1]) < seen


@pytest.mark.parametrize("schedule", ["prefill", "decode"])
def test_tova_default_keeps_one_set_per_layer(arch, model, schedule):
    """TOVA's default ``heads="layer"`` (the official code): one score, the last query's attention averaged
    over every query head of the layer, so all KV heads of a layer keep the same positions — after the
    prompt and, under ``decode``, after every eviction step. ``heads="group"`` selects per KV head."""
    ids = prompt(batch=2, length=PROMPT_LEN, seed=14)
    cache = kvsieve.KVCache(model, "tova", budget=8, schedule=schedule)
    assert cache.policy.scorer.heads == "layer"
    heads = cache.info.num_kv_heads

    def check(step: int) -> None:
        for layer in managed_layers(cache):
            for b in range(ids.shape[0]):
                first = cache.kept_positions(layer, b, 0)
                for h in range(1, heads):
                    assert torch.equal(cache.kept_positions(layer, b, h), first), (step, layer, b, h)

    decode_loop(model, cache, ids, steps=4, after_step=check)
    grouped = kvsieve.KVCache(model, "tova", budget=8, schedule=schedule, heads="group")
    model(ids, **cache_kwargs(model, grouped))
    differs = any(
        not torch.equal(grouped.kept_positions(layer, b, h), grouped.kept_positions(layer, b, 0))
        for layer in managed_layers(grouped) for b in range(ids.shape[0]) for h in range(1, heads)
    )
    assert differs  # per-group selection really differs across heads, so the check above is not vacuous


def cropped_reference(ref_model, ids, cache) -> DynamicCache:
    """Plain-transformers prefill of ``ids``, with each managed layer gathered to the kept positions."""
    dyn, _ = reference_cache(ref_model, ids)
    batch, heads = ids.shape[0], cache.info.num_kv_heads
    for layer in managed_layers(cache):  # gemma3's sliding layers keep their own window in both
        index = torch.stack(
            [torch.stack([cache.kept_positions(layer, b, h) for h in range(heads)]) for b in range(batch)]
        )
        index = index[..., None].expand(-1, -1, -1, cache.info.head_dim)
        dyn.layers[layer].keys = dyn.layers[layer].keys.gather(2, index)
        dyn.layers[layer].values = dyn.layers[layer].values.gather(2, index)
    return dyn


@pytest.mark.parametrize("policy", ["streaming_llm", "snapkv", "h2o", "tova", "pyramidkv", "random"])
def test_decoding_after_eviction_matches_cropped_reference(arch, model, ref_model, policy):
    """Decode on a compressed cache == plain transformers on a DynamicCache cut to the kept entries."""
    params = {"budget": 8}
    if policy in ("snapkv", "pyramidkv"):
        params["window"] = 4
    ids = prompt(batch=2, length=PROMPT_LEN, seed=14)
    cache = kvsieve.KVCache(model, policy, **params)
    full = kvsieve.KVCache(model, "full")
    logits = model(ids, **cache_kwargs(model, cache)).logits
    model(ids, **cache_kwargs(model, full))
    _, ref_logits = reference_cache(ref_model, ids)
    assert torch.equal(logits, ref_logits)  # compaction happens after the prompt's own attention
    dyn = cropped_reference(ref_model, ids, cache)
    assert cache.get_seq_length() == PROMPT_LEN  # tokens seen, not held
    assert int(cache.head_lengths()[managed_layers(cache)].max()) < PROMPT_LEN
    atol = 1e-5 if sliding_layers(cache) else 0.0
    token = logits[:, -1:].argmax(-1)
    differs_from_full = False
    for step in range(4):
        ours = model(token, **cache_kwargs(model, cache)).logits
        position = torch.full((2, 1), PROMPT_LEN + step)
        expected = ref_model(token, **cache_kwargs(ref_model, dyn), position_ids=position).logits
        torch.testing.assert_close(ours, expected, atol=atol, rtol=0, msg=f"{policy} step {step}")
        assert cache.get_seq_length() == PROMPT_LEN + step + 1
        full_logits = model(token, **cache_kwargs(model, full)).logits
        differs_from_full |= (ours - full_logits).abs().max().item() > 1e-3
        token = ours[:, -1:].argmax(-1)
    assert differs_from_full, "eviction had no effect on the logits"


def test_cropped_reference_is_sensitive_to_rope_position(model, ref_model):
    """Sanity of the test above: decoding the reference at the *held* length instead of the seen
    length changes the logits, so a cache that reported held entries as its length would fail it."""
    ids = prompt(batch=2, length=PROMPT_LEN, seed=15)
    cache = kvsieve.KVCache(model, "streaming_llm", budget=8)
    token = model(ids, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    dyn_right, dyn_wrong = cropped_reference(ref_model, ids, cache), cropped_reference(ref_model, ids, cache)
    ours = model(token, **cache_kwargs(model, cache)).logits
    right = ref_model(token, **cache_kwargs(ref_model, dyn_right), position_ids=torch.full((2, 1), PROMPT_LEN)).logits
    wrong = ref_model(token, **cache_kwargs(ref_model, dyn_wrong), position_ids=torch.full((2, 1), 8)).logits
    torch.testing.assert_close(ours, right, atol=1e-5 if sliding_layers(cache) else 0.0, rtol=0)
    assert (ours - wrong).abs().max().item() > 1e-3


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_multi_chunk_prefill_keeps_positions_right(model, ref_model, policy):
    """A second prompt chunk after compression is placed at seen positions and compressed again."""
    params = {"budget": 8, "window": 4} if policy == "snapkv" else {"budget": 8}
    first, second = prompt(batch=1, length=20, seed=16), prompt(batch=1, length=6, seed=17)
    cache = kvsieve.KVCache(model, policy, **params)
    model(first, **cache_kwargs(model, cache))
    dyn = cropped_reference(ref_model, first, cache)
    ours = model(second, **cache_kwargs(model, cache)).logits
    expected = ref_model(second, **cache_kwargs(ref_model, dyn), position_ids=torch.arange(20, 26)[None]).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 26
    assert (cache.head_lengths()[managed_layers(cache)] == 8).all()
    if policy == "snapkv":  # the new window is kept
        for layer, _, _, positions in all_kept_positions(cache):
            if layer in managed_layers(cache):
                assert positions[-4:].tolist() == [22, 23, 24, 25]


def test_seq_length_counts_tokens_seen_not_held(model):
    ids = prompt(batch=1, length=PROMPT_LEN, seed=18)
    cache = kvsieve.KVCache(model, "streaming_llm", budget=6, schedule="decode")
    seen = []
    decode_loop(model, cache, ids, steps=5, after_step=lambda i: seen.append(cache.get_seq_length()))
    assert seen == [PROMPT_LEN + i for i in range(6)]
    assert (cache.head_lengths()[managed_layers(cache)] == 6).all()
    assert all(cache.get_seq_length(layer) == PROMPT_LEN + 5 for layer in range(3))
