"""A left-padded batch behaves like each prompt alone: same tokens, same logits, same kept entries.

Logits are compared with ``atol=rtol=1e-5`` (observed ≤ 3e-7): a padded batch attends over a ragged
store gathered into a padded, masked tensor, so SDPA sums in a different order than for one prompt.
"""

from __future__ import annotations

import pytest
import torch
from helpers import generate, left_pad, managed_layers, prompt

import kvsieve
from kvsieve.transformers_adapter import cache_kwargs

STEPS = 6
ATOL = RTOL = 1e-5

POLICIES = {
    "full": ("full", {}),
    "snapkv": ("snapkv", {"budget": 8, "window": 4}),
    "h2o": ("h2o", {"budget": 8}),
    "adakv": ("adakv", {"budget": 8, "window": 4}),
    "tova": ("tova", {"budget": 8}),
    "streaming_llm": ("streaming_llm", {"budget": 8}),
    "pyramidkv": ("pyramidkv", {"budget": 8, "window": 4}),
    "h2o-decode": ("h2o", {"budget": 8, "schedule": "decode", "buffer": 2}),
    "tova-decode": ("tova", {"budget": 6, "schedule": "decode"}),
    "streaming_llm-decode": ("streaming_llm", {"budget": 8, "schedule": "decode", "buffer": 1}),
    "exact_topk": ("exact_topk", {"budget": 5}),
}

CASES = [("llama", case) for case in POLICIES] + [("gemma3", case) for case in POLICIES]
CASES += [(arch, "full") for arch in ("qwen2", "qwen3", "mistral", "phi3")]
CASES += [(arch, "snapkv") for arch in ("qwen3", "phi3")]


def padded_prompts() -> list[torch.Tensor]:
    # lengths chosen so every prompt exceeds the budgets (and, for the longest, gemma3's window)
    return [prompt(length=n, seed=40 + n)[0] for n in (20, 11, 24)]


@pytest.mark.filterwarnings("ignore:kvsieve")  # pyramidkv's layer 0 budget (12) > the 11-token prompt
@pytest.mark.parametrize(("arch", "case"), CASES)
def test_padded_batch_equals_single_prompts(arch, case):
    from conftest import get_model

    model = get_model(arch, "kv")
    policy, params = POLICIES[case]
    prompts = padded_prompts()
    ids, mask, pads = left_pad(prompts)
    batch_cache = kvsieve.KVCache(model, policy, **params)
    batch_seq, batch_logits = generate(model, ids, batch_cache, STEPS, attention_mask=mask)
    assert batch_cache.get_seq_length() == ids.shape[1] + STEPS - 1
    lengths = batch_cache.head_lengths()
    for row, (p, pad) in enumerate(zip(prompts, pads, strict=True)):
        cache = kvsieve.KVCache(model, policy, **params)
        seq, logits = generate(model, p[None], cache, STEPS)
        assert torch.equal(seq[0, len(p) :], batch_seq[row, ids.shape[1] :]), f"row {row}"
        for step, (a, b) in enumerate(zip(logits, batch_logits, strict=True)):
            torch.testing.assert_close(a[0], b[row], atol=ATOL, rtol=RTOL, msg=f"row {row} step {step}")
        # the same entries are kept, at positions shifted by the padding, and no padding is stored
        assert torch.equal(cache.head_lengths()[:, 0], lengths[:, row])
        for layer in range(lengths.shape[0]):
            for head in range(lengths.shape[2]):
                alone = cache.kept_positions(layer, 0, head)
                batched = batch_cache.kept_positions(layer, row, head)
                assert torch.equal(alone + pad, batched), (row, layer, head)
                assert int(batched.min()) >= pad
                k_alone, v_alone = cache.kept_entries(layer, 0, head)
                k_batch, v_batch = batch_cache.kept_entries(layer, row, head)
                torch.testing.assert_close(k_alone, k_batch, atol=ATOL, rtol=RTOL)
                torch.testing.assert_close(v_alone, v_batch, atol=ATOL, rtol=RTOL)
    if policy not in ("full", "exact_topk"):  # sanity: the longest prompt was really compressed
        longest = max(range(len(prompts)), key=lambda r: len(prompts[r]))
        held = lengths[managed_layers(batch_cache), longest]
        assert bool((held < len(prompts[longest]) + STEPS - 1).all())


def test_padding_is_never_stored(model):
    ids, mask, pads = left_pad(padded_prompts())
    cache = kvsieve.KVCache(model, "full")
    model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    lengths = cache.head_lengths()
    for row, pad in enumerate(pads):
        expected = ids.shape[1] - pad
        for layer, window in enumerate(cache.info.sliding_windows):
            if window is None:
                assert (lengths[layer, row] == expected).all()
            else:
                assert (lengths[layer, row] <= min(expected, window)).all()
    assert cache.kv_nbytes() == int(lengths.sum()) * 2 * cache.info.head_dim * 4


def test_mask_must_cover_all_tokens(model):
    """A padded mask that does not cover past + new tokens is rejected, and nothing is stored."""
    ids, mask, _ = left_pad(padded_prompts())
    cache = kvsieve.KVCache(model, "snapkv", budget=8, window=4)
    out = model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    before, seen = cache.head_lengths(), cache.get_seq_length()
    token = out.logits[:, -1:].argmax(-1)
    short = mask[:, :1]  # has padding zeros but covers only one token
    assert not short.all()
    with pytest.raises(ValueError, match="attention_mask"):
        model(token, attention_mask=short, **cache_kwargs(model, cache))
    assert torch.equal(cache.head_lengths(), before)
    assert cache.get_seq_length() == seen
    # the cache still works with the right mask
    model(token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == seen + 1
