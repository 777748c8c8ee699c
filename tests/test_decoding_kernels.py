"""Decoding over a compressed layer with the GQA group packed into the query axis (CPU, half precision), and the
full cache keeping transformers' own call (bit for bit) in the same dtype."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from helpers import prompt
from transformers import DynamicCache

import kvsieve
from kvsieve.engine import attention_output
from kvsieve.transformers_adapter import cache_kwargs


@pytest.fixture(scope="module")
def model():
    return build_model("llama").to(torch.bfloat16)  # 4 query heads over 2 KV heads


def greedy(model, cache, ids: torch.Tensor, steps: int = 6) -> torch.Tensor:
    logits = []
    with torch.inference_mode():
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            out = model(token, **cache_kwargs(model, cache), use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits)


def test_the_full_cache_keeps_transformers_call_in_bfloat16(model, monkeypatch):
    packed = []
    original = attention_output.packed_decoding_output
    monkeypatch.setattr(attention_output, "packed_decoding_output", lambda *a: packed.append(1) or original(*a))
    ids = prompt(2, 30, seed=3)
    reference = greedy(model, DynamicCache(config=model.config), ids)
    assert torch.equal(greedy(model, kvsieve.KVCache(model, "full"), ids), reference)
    with pytest.warns(UserWarning, match="nothing was compressed"):
        unevicted = greedy(model, kvsieve.KVCache(model, "snapkv", budget=64), ids)
    assert torch.equal(unevicted, reference)  # a budget above the prompt: nothing evicted
    assert packed == []


def test_a_compressed_layer_decodes_packed_and_as_the_grouped_call(model, monkeypatch):
    ids = prompt(2, 40, seed=4)
    calls = []
    original = attention_output.packed_decoding_output
    monkeypatch.setattr(attention_output, "packed_decoding_output", lambda *a: calls.append(1) or original(*a))
    packed = greedy(model, kvsieve.KVCache(model, "snapkv", budget=12, window=4), ids)
    assert calls  # the compressed layers decoded packed
    monkeypatch.setattr(attention_output, "packs_decoding_query", lambda step: False)
    grouped = greedy(model, kvsieve.KVCache(model, "snapkv", budget=12, window=4), ids)
    torch.testing.assert_close(packed, grouped, atol=0.05, rtol=0.02)  # bfloat16 rounding of two SDPA kernels


def test_packing_matches_the_dense_reference():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 1, 16, generator=generator)
    keys, values = torch.randn(2, 2, 9, 16, generator=generator), torch.randn(2, 2, 9, 16, generator=generator)
    out = attention_output.packed_decoding_output(query.bfloat16(), keys.bfloat16(), values.bfloat16(), 0.25)
    weights = torch.softmax(query @ keys.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.25, dim=-1)
    reference = (weights @ values.repeat_interleave(3, dim=1)).transpose(1, 2)
    torch.testing.assert_close(out.float(), reference, atol=0.03, rtol=0.02)
