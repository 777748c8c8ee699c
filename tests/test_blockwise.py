"""Block-wise prefill under a hard budget (the ``blockwise`` schedule, CAOTE's setting)."""

from __future__ import annotations

import pytest
import torch
from helpers import decode_loop, left_pad, managed_layers, prompt

import kvsieve
from kvsieve.transformers_adapter import cache_kwargs

BUDGET, BLOCK = 12, 8
POLICIES = [
    ("h2o", {}),
    ("tova", {}),
    ("snapkv", {"window": 4}),
    ("streaming_llm", {}),
    ("adakv", {"window": 4}),
    ("random", {"seed": 3}),
]


def blockwise(name: str, params: dict, budget: int = BUDGET, block: int = BLOCK) -> dict:
    return {"policy": name, "budget": budget, "schedule": "blockwise", "block_size": block, **params}


def make(model, spec: dict) -> kvsieve.KVCache:
    spec = dict(spec)
    return kvsieve.KVCache(model, spec.pop("policy"), **spec)


@pytest.mark.parametrize(("name", "params"), POLICIES)
def test_peak_never_exceeds_budget_plus_block(arch, model, name, params):
    cache = make(model, blockwise(name, params))
    ids = prompt(batch=2, length=45, seed=4)
    peaks: list[int] = []

    def after(step: int) -> None:
        lengths = cache.head_lengths()[managed_layers(cache)]
        if name == "adakv":  # head budgets adapt; the layer's total is the bound
            assert int(lengths.sum(-1).max()) <= BUDGET * lengths.shape[-1], f"step {step}"
        else:
            assert int(lengths.max()) <= BUDGET, f"step {step}: {lengths.max()} > budget"
        peaks.append(cache.peak_head_length())

    decode_loop(model, cache, ids, steps=5, after_step=after)
    # Every block appended at most BLOCK entries on top of at most BUDGET held ones (adakv: per layer).
    heads = cache.info.num_kv_heads
    assert max(peaks) <= (BUDGET * heads if name == "adakv" else BUDGET) + BLOCK
    # ... and the bound is reached: eviction really happened block by block (45 > budget + block).
    assert max(peaks) > BUDGET


def test_peak_is_checked_after_every_block(model):
    """Feed the prompt block by block by hand: after each block every head is back at the budget."""
    cache = make(model, blockwise("h2o", {}))
    ids = prompt(batch=1, length=40, seed=5)
    for lo in range(0, 40, BLOCK):
        model(ids[:, lo : lo + BLOCK], **cache_kwargs(model, cache))
        held = cache.head_lengths()[managed_layers(cache)]
        assert int(held.max()) <= BUDGET
        assert cache.peak_head_length() <= BUDGET + BLOCK
        assert cache.get_seq_length() == min(lo + BLOCK, 40)


@pytest.mark.parametrize(("name", "params"), POLICIES)
def test_internal_blocks_equal_feeding_blocks(model, name, params):
    """One forward split into blocks per layer == the model fed one block at a time."""
    ids = prompt(batch=1, length=37, seed=6)
    whole = make(model, blockwise(name, params))
    logits_whole = model(ids, **cache_kwargs(model, whole)).logits
    fed = make(model, blockwise(name, params))
    parts = [model(ids[:, lo : lo + BLOCK], **cache_kwargs(model, fed)).logits for lo in range(0, 37, BLOCK)]
    torch.testing.assert_close(logits_whole, torch.cat(parts, dim=1), atol=1e-5, rtol=1e-5)
    for layer in managed_layers(whole):
        assert torch.equal(whole.kept_positions(layer), fed.kept_positions(layer))


@pytest.mark.parametrize(("name", "params"), POLICIES)
def test_budget_at_least_prompt_equals_normal_prefill(arch, model, ref_model, name, params):
    ids = prompt(batch=2, length=30, seed=7)
    reference = ref_model(ids).logits
    cache = make(model, blockwise(name, params, budget=64))
    logits = model(ids, **cache_kwargs(model, cache)).logits
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    full_tokens, _ = decode_loop(model, kvsieve.KVCache(model, "full"), ids, steps=4)
    block_tokens, _ = decode_loop(model, make(model, blockwise(name, params, budget=64)), ids, steps=4)
    assert torch.equal(full_tokens, block_tokens)


def test_blockwise_with_left_padding_matches_single_prompts(model):
    """Blocks follow the padded token stream, so a row matches its unpadded run when its padding is a
    whole number of blocks (here 8 = BLOCK); other paddings shift the block boundaries."""
    prompts = [prompt(1, 30, seed=8)[0], prompt(1, 22, seed=9)[0]]
    ids, mask, pads = left_pad(prompts)
    spec = blockwise("h2o", {})
    batched = make(model, spec)
    batch_tokens, _ = decode_loop(model, batched, ids, steps=4, attention_mask=mask)
    for row, single in enumerate(prompts):
        alone = make(model, spec)
        tokens, _ = decode_loop(model, alone, single[None], steps=4)
        assert torch.equal(tokens[0], batch_tokens[row])
        for layer in managed_layers(alone):
            shifted = batched.kept_positions(layer, row) - pads[row]
            assert torch.equal(shifted, alone.kept_positions(layer))


def test_blockwise_validation():
    with pytest.raises(kvsieve.PolicyConfigError, match="block_size"):
        kvsieve.make_policy("h2o", budget=8, schedule="blockwise", block_size=0)
    with pytest.raises(kvsieve.PolicyConfigError, match="absolute budget"):
        kvsieve.make_policy("h2o", ratio=0.5, schedule="blockwise")
    with pytest.raises(kvsieve.PolicyConfigError, match="cannot work"):
        kvsieve.make_policy("exact_topk", budget=8, schedule="blockwise")
