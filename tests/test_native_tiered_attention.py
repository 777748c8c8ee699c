"""The CPU's decoding attention over packed precision tiers (``kvsieve.native.tiered_attention``): the softmax
attention over exactly the dequantized entries (float64 reference), masks honoured, ragged tiers, every view dtype;
used by a mixed cache's decoding steps, and declined where it does not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_model
from helpers import NATIVE_TOLERANCE, decodes_alike, needs_native
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsieve
from kvsieve import KVCache
from kvsieve.cache.quantized_tier import QuantizedTier
from kvsieve.cache.store_tiers import StoreTiers
from kvsieve.native import tiered_attention
from kvsieve.native.tiered_attention import PackedTier, attend

pytestmark = needs_native(tiered_attention._kernel)
TOLERANCE = NATIVE_TOLERANCE


def _tier(batch: int, heads: int, dim: int, bits: int, group: int, value_group: int, counts: list[int], seed: int,
          drop: bool) -> QuantizedTier:
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    tier = QuantizedTier(batch, heads, dim, bits, group, value_group, torch.float32, torch.device("cpu"))
    keys = torch.randn(n, dim, generator=gen) * 2
    keys[:, 0] += 6  # an outlier channel
    tier.add(keys, torch.randn(n, dim, generator=gen), torch.cat([torch.arange(c) for c in counts]),
             torch.tensor(counts))
    if drop and not tier.empty:
        _, _, positions, _ = tier.dense()
        keep = torch.ones(positions.shape, dtype=torch.bool)
        keep[..., 1::4] = False
        tier.keep(keep)
    return tier


def _packed(tier: QuantizedTier) -> tuple[PackedTier, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tier as the pass reads it, and its exact float32 keys, values and validity in its slot layout."""
    index, positions, valid = tier.attention_layout()
    shape = (tier.batch, tier.heads, positions.shape[2], tier.head_dim)
    keys, values = torch.empty(shape), torch.empty(shape)
    tier.dequantized(index, (keys, values), native=False)
    ok = torch.ones(shape[:3], dtype=torch.bool) if valid is None else valid
    packed = PackedTier(tier.bits, tier.group, tier.value_group, tier.key_codes, tier.key_params, tier.value_codes,
                        tier.value_params, index, valid, positions.shape[2])
    return packed, keys, values, ok


def _reference(query, scaling, parts):
    """Float64 softmax attention over every part's valid entries, ``(batch, 1, q_heads, d)``."""
    batch, q_heads, _, dim = query.shape
    keys = torch.cat([p[0] for p in parts], dim=2).double()
    values = torch.cat([p[1] for p in parts], dim=2).double()
    valid = torch.cat([p[2] for p in parts], dim=2)
    rows = q_heads // keys.shape[1]
    q = query.double().view(batch, keys.shape[1], rows, dim)
    logits = torch.einsum("bhgd,bhld->bhgl", q, keys) * scaling
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    out = torch.einsum("bhgl,bhld->bhgd", torch.softmax(logits, dim=-1), values)
    return out.reshape(batch, 1, q_heads, dim)


@given(batch=st.integers(1, 3), heads=st.integers(1, 3), rows=st.sampled_from([1, 3, 4]),
       dim=st.sampled_from([16, 64]), full=st.integers(0, 40), tiers=st.sampled_from([(2,), (4,), (8,), (4, 2)]),
       group=st.sampled_from([4, 32]), split=st.sampled_from([1, 2]), ragged=st.booleans(), drop=st.booleans(),
       padded_full=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 99))
@settings(max_examples=80, deadline=None, derandomize=True)
def test_the_output_is_softmax_attention_over_the_dequantized_entries(batch, heads, rows, dim, full, tiers, group,
                                                                     split, ragged, drop, padded_full, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    segments = batch * heads
    query = (torch.randn(batch, heads * rows, 1, dim, generator=gen) * 2).to(dtype)
    scaling = dim ** -0.5
    # the full-precision part: a slice of a larger buffer (strided), some slots padded when ragged
    buffer = torch.randn(batch, heads, full + 9, dim, generator=gen).to(dtype)
    keys, values = buffer[:, :, 2: 2 + full], buffer.flip(-1)[:, :, 2: 2 + full]
    values = values.contiguous().as_strided(keys.shape, keys.stride()) if values.stride() != keys.stride() else values
    valid = None
    if padded_full and full:
        valid = torch.rand(batch, heads, full, generator=gen) < 0.8
        valid[..., 0] = True  # every row sees something
    parts = [(keys.float(), values.float(),
              torch.ones(batch, heads, full, dtype=torch.bool) if valid is None else valid)]
    packed = []
    for number, bits in enumerate(tiers):
        counts = [int(c) for c in torch.randint(1, 50, (segments,), generator=gen)] if ragged else [37] * segments
        tier = _tier(batch, heads, dim, bits, group, dim // split, counts, seed + number, drop)
        if tier.empty:
            continue
        packed_tier, tier_keys, tier_values, tier_valid = _packed(tier)
        packed.append(packed_tier)
        parts.append((tier_keys, tier_values, tier_valid))
    if not packed and not full:
        return
    out = attend(query, scaling, keys, values, valid, packed)
    assert out is not None and out.dtype == dtype and out.shape == (batch, 1, heads * rows, dim)
    expected = _reference(query, scaling, parts)
    torch.testing.assert_close(out.double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_invalid_entries_have_no_weight_whatever_they_hold():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 1, 16, generator=gen)
    keys, values = torch.randn(1, 1, 10, 16, generator=gen), torch.randn(1, 1, 10, 16, generator=gen)
    valid = torch.ones(1, 1, 10, dtype=torch.bool)
    valid[..., 3:6] = False
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    poisoned_keys[:, :, 3:6] = 1e4
    poisoned_values[:, :, 3:6] = float("nan")
    kept = valid[0, 0]
    expected = attend(query, 0.25, keys[:, :, kept], values[:, :, kept], None, [])
    got = attend(query, 0.25, poisoned_keys, poisoned_values, valid, [])
    assert got is not None and expected is not None
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_what_it_does_not_take_is_left_to_the_pytorch_path(monkeypatch):
    query, keys = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 5, 16)
    assert attend(query, 0.25, keys, keys, None, []) is not None
    assert attend(torch.randn(1, 2, 1, 12), 0.25, torch.randn(1, 1, 5, 12), torch.randn(1, 1, 5, 12), None,
                  []) is None  # a head size not a multiple of 8
    assert attend(torch.randn(1, 2, 2, 16), 0.25, keys, keys, None, []) is None  # two queries: not a decoding step
    assert attend(torch.randn(1, 17, 1, 16), 0.25, keys, keys, None, []) is None  # 17 query heads per KV head
    assert attend(query, 0.25, keys.double(), keys.double(), None, []) is None  # a dtype it does not read
    meta = torch.empty(1, 1, 5, 16, device="meta")
    assert attend(query.to("meta"), 0.25, meta, meta, None, []) is None  # off the CPU
    monkeypatch.setattr(tiered_attention, "_kernel", lambda: None)
    assert attend(query, 0.25, keys, keys, None, []) is None  # no built library


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_cache_decodes_through_the_pass_close_to_the_dequantized_view(monkeypatch, dtype):
    """Every decoding step of every layer takes the pass; the logits stay within rounding of the PyTorch path's
    (dequantized view + SDPA) and the greedy tokens are the same."""
    model = build_model("llama").to(dtype)
    prompt = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    taken = []
    real = StoreTiers.decoding_output

    def spy(self, query, scaling):
        out = real(self, query, scaling)
        taken.append(out is not None)
        return out

    decodes_alike(model, lambda: KVCache(model, "mixed", budget=16, window=2, group=4, value_group=8), prompt, dtype,
                  lambda on: monkeypatch.setattr(StoreTiers, "decoding_output",
                                                 spy if on else (lambda self, query, scaling: None)))
    assert taken and all(taken), "a decoding step of the mixed cache did not take the pass over packed tiers"
    assert len(taken) == 4 * model.config.num_hidden_layers


def test_a_deep_copy_reads_its_own_packed_tiers():
    """The pass keeps the tiers' addresses per tier version; a deep copy (same versions) must not read the original's
    buffers: zeroing the original's codes after the copy leaves the copy's next step as it was."""
    model = build_model("llama")
    prompt = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model, "mixed", budget=16, window=2, group=4, value_group=8)
    with torch.no_grad():
        token = model(prompt, **kvsieve.cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
        model(token, **kvsieve.cache_kwargs(model, cache), use_cache=True)  # the packed tiers are cached now
        twin, reference = copy.deepcopy(cache), copy.deepcopy(cache)
        expected = model(token, **kvsieve.cache_kwargs(model, reference), use_cache=True).logits
        for layer in range(model.config.num_hidden_layers):
            for tier in cache._store(layer).tiers:
                tier.key_codes.zero_()
                tier.value_codes.zero_()
        got = model(token, **kvsieve.cache_kwargs(model, twin), use_cache=True).logits
    assert torch.equal(got, expected)
