"""One prompt forward filling several caches gives each exactly the state of its own prefill."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import left_pad, prompt

import kvsieve
from kvsieve.engine.shared_prefill import prefill_shared
from kvsieve.transformers_adapter import cache_kwargs

pytestmark = pytest.mark.compat  # runs in the transformers-version matrix (scripts/compat_matrix.sh)

#: (policy, params): every scoring family, a budget allocator, a decode-schedule policy and a full cache.
SPECS = [
    ("full", {}),
    ("snapkv", {"budget": 8, "window": 4}),
    ("h2o", {"budget": 6}),
    ("tova", {"budget": 10}),
    ("streaming_llm", {"budget": 8}),
    ("pyramidkv", {"budget": 8, "window": 4}),
    ("adakv", {"budget": 8, "window": 4}),
    ("restkv", {"budget": 8, "window": 4}),
    ("h2o_caote", {"budget": 8}),
    ("random", {"budget": 7, "seed": 3}),
    ("h2o", {"budget": 9, "schedule": "decode"}),
    ("exact_topk", {"budget": 4}),
]


def _caches(model: torch.nn.Module) -> list[kvsieve.KVCache]:
    return [kvsieve.KVCache(model, name, **params) for name, params in SPECS]


def _assert_same_state(a: kvsieve.KVCache, b: kvsieve.KVCache) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    assert torch.equal(a.head_lengths(), b.head_lengths())
    for layer_idx, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        assert la.store is not None and lb.store is not None
        for batch in range(la.store.batch):
            for head in range(la.store.heads):
                assert torch.equal(a.kept_positions(layer_idx, batch, head), b.kept_positions(layer_idx, batch, head))
                ka, va = a.kept_entries(layer_idx, batch, head)
                kb, vb = b.kept_entries(layer_idx, batch, head)
                assert torch.equal(ka, kb) and torch.equal(va, vb)


def _assert_same_decoding(model: torch.nn.Module, cache: kvsieve.KVCache, alone: kvsieve.KVCache,
                          logits: torch.Tensor, name: str, steps: int = 3) -> None:
    """Both caches continue identically: greedy steps from the prompt's ``logits`` give equal logits."""
    nxt = logits[:, -1:].argmax(-1)
    for _ in range(steps):
        la = model(input_ids=nxt, **cache_kwargs(model, cache), use_cache=True).logits
        lb = model(input_ids=nxt, **cache_kwargs(model, alone), use_cache=True).logits
        assert torch.equal(la, lb), name
        nxt = la[:, -1:].argmax(-1)


def test_every_cache_matches_its_own_prefill_and_decodes_the_same(model):
    ids = prompt(length=40, seed=5)
    shared = _caches(model)
    out = prefill_shared(model, ids, shared)
    for (name, params), cache in zip(SPECS, shared, strict=True):
        alone = kvsieve.KVCache(model, name, **params)
        own = model(input_ids=ids, **cache_kwargs(model, alone), use_cache=True)
        assert torch.equal(out.logits, own.logits), name
        _assert_same_state(cache, alone)
        _assert_same_decoding(model, cache, alone, own.logits, name)  # policies that act at decoding included
    # Nothing is left linking the caches.
    assert all(not layer.followers for cache in shared for layer in cache.layers)


def test_left_padded_batch(model):
    ids, mask, _ = left_pad([prompt(length=30, seed=1)[0], prompt(length=22, seed=2)[0]])
    specs = [("snapkv", {"budget": 8, "window": 4}), ("h2o", {"budget": 8})]
    shared = [kvsieve.KVCache(model, name, **params) for name, params in specs]
    out = prefill_shared(model, ids, shared, attention_mask=mask)
    for (name, params), cache in zip(specs, shared, strict=True):
        alone = kvsieve.KVCache(model, name, **params)
        own = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, alone), use_cache=True)
        assert torch.equal(out.logits, own.logits)
        _assert_same_state(cache, alone)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: [], "at least one"),
        (lambda m: [kvsieve.KVCache(m, "h2o", budget=8, schedule="blockwise", block_size=8)], "blockwise"),
        (lambda m: [kvsieve.KVCache(m, "tova", budget=8)] * 2, "twice"),
    ],
)
def test_rejects_unshareable_caches_before_any_work(model, make, match):
    caches = make(model)
    with pytest.raises(ValueError, match=match):
        prefill_shared(model, prompt(length=20), caches)
    assert all(c.get_seq_length() == 0 for c in caches)


def test_rejects_used_cache_and_short_prompt(model):
    used = kvsieve.KVCache(model, "tova", budget=8)
    model(input_ids=prompt(length=12), **cache_kwargs(model, used), use_cache=True)
    fresh = kvsieve.KVCache(model, "h2o", budget=8)
    with pytest.raises(ValueError, match=r"caches\[1\] is not empty"):
        prefill_shared(model, prompt(length=20), [fresh, used])
    assert fresh.get_seq_length() == 0
    with pytest.raises(ValueError, match="tokens ≥ 2"):
        prefill_shared(model, prompt(length=1), [fresh])


def test_failed_forward_resets_every_cache(model):
    caches = [kvsieve.KVCache(model, "h2o", budget=8), kvsieve.KVCache(model, "tova", budget=8)]
    bad_mask = torch.ones(1, 5, dtype=torch.long)  # shorter than the prompt
    with pytest.raises(Exception):  # noqa: B017 - whatever the model raises, the caches must be reset
        prefill_shared(model, prompt(length=20), caches, attention_mask=bad_mask)
    for cache in caches:
        assert cache.get_seq_length() == 0
        assert all(layer.store is None and not layer.followers for layer in cache.layers)


def test_bf16_prompt_followers_take_their_own_prefills_sums(model, monkeypatch):
    """A bfloat16 prompt on the CPU takes the flash kernel's route for the column sums (its output is SDPA's) in
    every cache that needs them, lead or follower, whatever its budget or action: a follower keeps what its own
    prefill keeps, with the same side data (H2O's and EMS's sums), and decodes the same."""
    from kvsieve.engine.engine import Engine

    taken: list[bool] = []
    original = Engine._flash_statistics

    def spy(self, call, step):
        result = original(self, call, step)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(Engine, "_flash_statistics", spy)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the session's model stays float32
    specs = [("snapkv", {"budget": 8, "window": 4}), ("h2o", {"budget": 6}), ("ems", {"budget": 12, "window": 4}),
             ("ems_pos", {"budget": 12, "window": 4}), ("h2o_caote", {"budget": 8}),
             ("h2o", {"budget": 64, "schedule": "decode"})]  # the last holds the whole prompt: nothing evicted
    ids = prompt(length=40, seed=6)
    shared = [kvsieve.KVCache(bf16, name, **params) for name, params in specs]
    with torch.inference_mode():
        out = prefill_shared(bf16, ids, shared)
        assert taken and any(taken)
        for (name, params), cache in zip(specs, shared, strict=True):
            alone = kvsieve.KVCache(bf16, name, **params)
            own = bf16(input_ids=ids, **cache_kwargs(bf16, alone), use_cache=True)
            assert torch.equal(out.logits, own.logits), name
            _assert_same_state(cache, alone)
            for la, lb in zip(cache.layers, alone.layers, strict=True):
                side_a, side_b = la.store.dense().extras, lb.store.dense().extras
                assert side_a.keys() == side_b.keys()
                assert all(torch.equal(side_a[key], side_b[key]) for key in side_a), name
            _assert_same_decoding(bf16, cache, alone, own.logits, name)
