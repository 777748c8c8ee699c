"""Decoding over a compressed layer with the GQA group packed into the query axis (CPU, half precision; ragged heads
with their validity mask on every device), and the full cache keeping transformers' own call (bit for bit)."""

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
    monkeypatch.setattr(attention_output, "packs_query", lambda *args: False)
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


def transformers_masked_call(query, keys, values, scaling, valid):
    """What decoding ragged heads called before packing: transformers' SDPA wrapper with the validity repeated per
    query head (it then repeats every key and value per query head too)."""
    from types import SimpleNamespace

    from kvsieve.transformers_adapter import sdpa_attention

    groups = query.shape[1] // keys.shape[1]
    module = SimpleNamespace(is_causal=False, num_key_value_groups=groups, training=False)
    return sdpa_attention(module, query, keys, values, valid.unsqueeze(-2).repeat_interleave(groups, dim=1), scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_packing_is_transformers_masked_call_bit_for_bit(dtype):
    """Ragged heads (a padded view with validity): the packed call with one mask row per KV head gives what
    transformers' masked SDPA call gives after repeating every key, value and mask row per query head (bit for bit
    with torch 2.13 on this CPU; within rounding promised: torch 2.11 on another CPU differed in float32)."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(3, 6, 1, 16, generator=generator).to(dtype)
    keys = torch.randn(3, 2, 37, 16, generator=generator).to(dtype)
    values = torch.randn(3, 2, 37, 16, generator=generator).to(dtype)
    valid = torch.rand(3, 2, 37, generator=generator) > 0.3
    valid[..., 0] = True
    reference = transformers_masked_call(query, keys, values, 0.25, valid)
    out = attention_output.packed_decoding_output(query, keys, values, 0.25, valid)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, reference, atol=tolerance, rtol=tolerance)
    dense = attention_output.packed_decoding_output(query, keys, values, 0.25, torch.ones_like(valid))
    assert not torch.equal(out, dense)  # the mask took effect


def test_ragged_decoding_is_packed_and_unchanged(model, monkeypatch, pytorch_ragged_decoding):
    """adakv (ragged heads after its compaction) decodes through the masked packed call (its PyTorch route), and gives
    the logits the masked transformers call gives (bfloat16, within its rounding)."""
    ids = prompt(2, 48, seed=6)
    calls = []
    original = attention_output.packed_decoding_output
    monkeypatch.setattr(attention_output, "packed_decoding_output",
                        lambda *a: calls.append(len(a)) or original(*a))
    packed = greedy(model, kvsieve.KVCache(model, "adakv", budget=12, window=4), ids)
    assert 5 in calls  # some layer decoded ragged, with its validity

    monkeypatch.setattr(attention_output, "packed_decoding_output",
                        lambda *a: original(*a) if len(a) == 4 else transformers_masked_call(*a))
    masked = greedy(model, kvsieve.KVCache(model, "adakv", budget=12, window=4), ids)
    torch.testing.assert_close(masked, packed, atol=0.05, rtol=0.02)  # bfloat16: equal here, rounding elsewhere
