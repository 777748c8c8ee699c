"""Same inputs → identical outputs and kept positions; the random policy is seeded."""

from __future__ import annotations

import pytest
import torch
from conftest import get_model
from helpers import all_kept_positions, decode_loop, prompt

import kvsieve
from kvsieve.transformers_adapter import cache_kwargs

CASES = {
    "random": ("random", {"budget": 8}),
    "random-decode": ("random", {"budget": 8, "schedule": "decode", "buffer": 1}),
    "snapkv": ("snapkv", {"budget": 8, "window": 4}),
    "h2o-decode": ("h2o", {"budget": 8, "schedule": "decode"}),
    "tova": ("tova", {"budget": 8}),
    "adakv": ("adakv", {"budget": 8, "window": 4}),
    "pyramidkv": ("pyramidkv", {"budget": 8, "window": 4}),
}


def run(model, policy, params, ids):
    cache = kvsieve.KVCache(model, policy, **params)
    tokens, logits = decode_loop(model, cache, ids, steps=5)
    kept = [p.tolist() for *_, p in all_kept_positions(cache)]
    return tokens, torch.stack(logits), kept, cache.head_lengths()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_runs_are_identical(arch, case):
    model = get_model(arch, "kv")
    policy, params = CASES[case]
    ids = prompt(batch=2, length=24, seed=50)
    first, second = run(model, policy, params, ids), run(model, policy, params, ids)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])
    assert first[2] == second[2]
    assert torch.equal(first[3], second[3])


def test_random_seed_changes_kept_set(model):
    ids = prompt(batch=2, length=24, seed=51)
    kept = {}
    for seed in (0, 1):
        cache = kvsieve.KVCache(model, "random", budget=8, seed=seed)
        model(ids, **cache_kwargs(model, cache))
        kept[seed] = [p.tolist() for *_, p in all_kept_positions(cache)]
    assert kept[0] != kept[1]


def test_random_differs_across_layers_heads_and_steps(model):
    """The generator is seeded per (seed, layer, forward): not the same subset everywhere."""
    ids = prompt(batch=1, length=24, seed=52)
    cache = kvsieve.KVCache(model, "random", budget=8, schedule="decode")
    model(ids, **cache_kwargs(model, cache))
    kept = [
        tuple(p.tolist()) for layer, _, _, p in all_kept_positions(cache) if cache.info.sliding_windows[layer] is None
    ]
    assert len(set(kept)) > 1
