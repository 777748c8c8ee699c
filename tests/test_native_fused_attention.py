"""The AMX pass computing a causal bfloat16 prompt's attention output, log-sum-exp and column sums from one set of
exponentials (``kvsieve.native.fused_attention``), against a float64 reference: every output element within
``2⁻⁹·(|exact| + max|v|)`` of the exact attention (bfloat16's rounding of the result plus that of the probabilities —
the bound SDPA's own output meets), the log-sum-exp and the sums within float32 rounding. In a model it serves
``fuse_statistics=True``: logits within bfloat16 rounding of the unfused prefill, the first layer's kept entries the
same."""

from __future__ import annotations

import pytest
import torch
from conftest import _COMMON, ALL_ARCHS, EAGER_ARCHS, build_model
from helpers import all_kept_positions, prompt
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

import kvsieve
from kvsieve.native import fused_attention
from kvsieve.native.fused_attention import causal_attention_with_column_sums
from kvsieve.transformers_adapter import cache_kwargs

TILES = pytest.mark.skipif(not fused_attention.tiles(), reason="no AMX-BF16 tiles in this build")
VECTORS = pytest.mark.skipif(not fused_attention.vector_code(), reason="neither AVX-512 nor AVX2 in this build")
#: Each dtype's pass, and what it needs.
DTYPES = [pytest.param(torch.bfloat16, marks=TILES, id="bf16"), pytest.param(torch.float32, marks=VECTORS, id="f32")]
#: The bound on each output element's error over ``|exact| + max|v|``: bfloat16's rounding of the result and of the
#: probabilities, or float32's.
BOUND = {torch.bfloat16: 2.0**-9, torch.float32: 2.0**-18}


def _inputs(batch, kv_heads, groups, n, dim, seed, spread=1.0, strided=True, dtype=torch.bfloat16):
    """Queries ``(batch, q_heads, n, d)`` and keys/values ``(batch, kv_heads, n, d)`` in ``dtype``: by default strided
    as a model's projections leave them (``(batch, n, heads, d)`` transposed)."""
    generator = torch.Generator().manual_seed(seed)

    def make(heads, scale):
        if strided:
            return (torch.randn(batch, n, heads, dim, generator=generator) * scale).to(dtype).transpose(1, 2)
        return (torch.randn(batch, heads, n, dim, generator=generator) * scale).to(dtype)

    return make(kv_heads * groups, spread), make(kv_heads, 1.0), make(kv_heads, 2.0)


def _check(query, keys, values, scaling):
    result = causal_attention_with_column_sums(query, keys, values, scaling)
    assert result is not None
    output, logsumexp, sums = result
    batch, q_heads, n, dim = query.shape
    groups = q_heads // keys.shape[1]
    keys64 = keys.double().repeat_interleave(groups, dim=1)
    values64 = values.double().repeat_interleave(groups, dim=1)
    logits = (query.double() @ keys64.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    probs = logits.softmax(-1)
    exact = (probs @ values64).transpose(1, 2)  # (batch, n, q_heads, d)
    assert output.shape == (batch, n, q_heads, dim) and output.dtype == query.dtype
    largest_value = values64.abs().amax(dim=(2, 3))[:, None, :, None]
    assert ((output.double() - exact).abs() <= BOUND[query.dtype] * (exact.abs() + largest_value)).all()
    # bfloat16 products are exact in float32; float32 ones round, and a logit's rounding is its probability's relative
    # error (as in the PyTorch softmax pass)
    rtol = 2e-6 if query.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(logsumexp.double(), logits.logsumexp(-1), rtol=rtol, atol=rtol)
    torch.testing.assert_close(sums.double(), probs.sum(dim=2), rtol=rtol, atol=1e-7)
    return output


@pytest.mark.parametrize(("batch", "kv_heads", "groups", "n", "dim"), [
    (2, 3, 3, 200, 64),   # the default model's grouping, several units and a partial last one
    (1, 4, 1, 77, 128),   # two rounds of 64 dimensions for the output
    (1, 2, 3, 300, 96),   # a round of 64 dimensions, then one of 32
    (1, 1, 2, 17, 32),
    (1, 1, 1, 1000, 64),  # many rounds of 64 keys
    (1, 1, 1, 2, 256),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_logsumexp_and_sums_match_the_float64_reference(batch, kv_heads, groups, n, dim, dtype):
    query, keys, values = _inputs(batch, kv_heads, groups, n, dim, seed=n, dtype=dtype)
    output = _check(query, keys, values, dim**-0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1), is_causal=True,
        scale=dim**-0.5).transpose(1, 2)
    # not SDPA's bit for bit (the probabilities round at other points), but within its rounding
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(output.float(), sdpa.float(), rtol=tolerance, atol=tolerance)


@TILES
@settings(max_examples=30, deadline=None, derandomize=True)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), groups=st.integers(1, 3), n=st.integers(1, 300),
       dim=st.sampled_from([32, 64, 96, 128, 256]), spread=st.floats(0.1, 4.0), strided=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_shape_matches_the_reference(batch, kv_heads, groups, n, dim, spread, strided, seed):
    """Sharp and flat attention (``spread`` scales the queries), contiguous or strided inputs, one query to 300."""
    query, keys, values = _inputs(batch, kv_heads, groups, n, dim, seed, spread, strided)
    _check(query, keys, values, dim**-0.5)


@VECTORS
@settings(max_examples=30, deadline=None, derandomize=True)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), groups=st.integers(1, 3), n=st.integers(1, 300),
       dim=st.sampled_from([16, 48, 64, 80, 128, 256]), spread=st.floats(0.1, 4.0), strided=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_float32_shape_matches_the_reference(batch, kv_heads, groups, n, dim, spread, strided, seed):
    """The float32 pass (head sizes that are multiples of 16) likewise."""
    query, keys, values = _inputs(batch, kv_heads, groups, n, dim, seed, spread, strided, torch.float32)
    _check(query, keys, values, dim**-0.5)


@VECTORS
@pytest.mark.parametrize("spread", [30.0, 300.0])
def test_sharp_float32_attention_whose_probabilities_underflow(spread):
    """Queries scaled so that most logits lie hundreds below their row's maximum: the exponentials of 2^x with x far
    below -126 must come out 0 (the AVX2 pass sets 2^n in the exponent's bits, clamped), not garbage."""
    query, keys, values = _inputs(1, 2, 2, 150, 64, seed=3, spread=spread, dtype=torch.float32)
    output, logsumexp, sums = causal_attention_with_column_sums(query, keys, values, 0.125)
    keys64, values64 = keys.double().repeat_interleave(2, dim=1), values.double().repeat_interleave(2, dim=1)
    logits = (query.double() @ keys64.transpose(-1, -2) * 0.125).tril()
    rounding = logits.abs().max() * 2.0**-23  # a float32 logit's rounding: each probability's relative error
    logits = logits.masked_fill(torch.ones(150, 150, dtype=torch.bool).triu(1), float("-inf"))
    assert (torch.exp(logits - logits.amax(-1, keepdim=True)) < 2.0**-126).double().mean() > 0.5  # most underflow
    probs = logits.softmax(-1)
    exact = (probs @ values64).transpose(1, 2)
    scale = exact.abs() + values64.abs().amax(dim=(2, 3))[:, None, :, None]
    assert ((output.double() - exact).abs() <= rounding * scale).all()
    torch.testing.assert_close(logsumexp.double(), logits.logsumexp(-1), rtol=1e-5, atol=0)
    assert ((sums.double() - probs.sum(dim=2)).abs() <= 2 * rounding).all()


@TILES
@VECTORS
def test_what_it_does_not_take_is_declined():
    query, keys, values = _inputs(1, 2, 2, 40, 64, seed=0)
    assert causal_attention_with_column_sums(query, keys, values, 0.125) is not None
    assert causal_attention_with_column_sums(query.half(), keys.half(), values.half(), 0.125) is None
    assert causal_attention_with_column_sums(query.double(), keys.double(), values.double(), 0.125) is None
    assert causal_attention_with_column_sums(query.float(), keys, values, 0.125) is None  # mixed dtypes
    for dim in (16, 48, 288):  # bfloat16: not a multiple of 32, or above 256
        assert causal_attention_with_column_sums(*_inputs(1, 2, 2, 40, dim, seed=0), 0.125) is None
    for dim in (24, 272):  # float32: not a multiple of 16, or above 256
        assert causal_attention_with_column_sums(*_inputs(1, 2, 2, 40, dim, seed=0, dtype=torch.float32), 0.125) is None
    assert causal_attention_with_column_sums(query, keys[:, :, :30], values[:, :, :30], 0.125) is None
    assert causal_attention_with_column_sums(query[:, :3], keys, values, 0.125) is None  # 3 over 2 KV heads
    assert causal_attention_with_column_sums(query, keys, values[..., :32], 0.125) is None


def _model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    """A tiny model whose heads have 32 dimensions (the tiles' multiple; the shared tiny models have 16)."""
    common = {**_COMMON, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "sliding_window": None}
    config, cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                   "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    torch.manual_seed(0)
    return cls(config(**common, attn_implementation="sdpa")).eval().to(dtype)


def _prefills(model, ids, policy: str, params: dict, monkeypatch) -> tuple[list[bool], list]:
    """The prompt's prefill with ``fuse_statistics`` on, then off: whether each call of the pass ran, and per prefill
    the float32 logits and the kept positions per (layer, row, head)."""
    calls: list[bool] = []

    def spy(*args):
        result = causal_attention_with_column_sums(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr("kvsieve.core.step.causal_attention_with_column_sums", spy)
    runs = []
    for fused in (True, False):
        cache = kvsieve.KVCache(model, policy, fuse_statistics=fused, **params)
        with torch.inference_mode():
            logits = model(ids, **cache_kwargs(model, cache)).logits
        cache.flush()
        runs.append((logits.float(), [positions.tolist() for *_, positions in all_kept_positions(cache)]))
    return calls, runs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("policy", ["h2o", "ems"])
def test_fused_prefill_takes_the_pass_with_the_unfused_entries(arch, policy, dtype, monkeypatch):
    """``fuse_statistics=True`` takes the pass in every layer; the logits are within bfloat16 rounding of the unfused
    prefill's (SDPA and the flash route's sums); the first layer keeps the same entries, the others nearly all."""
    model = _model(arch, dtype)
    params = {"window": 8} if policy == "ems" else {}
    calls, runs = _prefills(model, prompt(2, 150, seed=7), policy, {"budget": 40, **params}, monkeypatch)
    assert calls == [True] * model.config.num_hidden_layers
    tolerance = 0.05 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=tolerance, atol=tolerance)
    # the first layer sees the same inputs either way: the same entries (its sums differ by float32 rounding); later
    # layers see inputs that differ by bfloat16 rounding, so a near tie may fall the other way
    first_layer = len(runs[0][1]) // model.config.num_hidden_layers
    assert runs[0][1][:first_layer] == runs[1][1][:first_layer]
    shared = sum(len(set(a) & set(b)) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    assert shared >= 0.95 * sum(len(a) for a in runs[1][1])


@VECTORS
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_float32_fused_prefill_on_every_architecture(arch, monkeypatch):
    """The shared tiny float32 models (16-dimensional heads) take the float32 pass in every full-attention layer of an
    unpadded prompt — not where soft-capping or sinks need the explicit attention — with logits within float32
    rounding of the unfused prefill and the same kept entries."""
    model = build_model(arch)
    calls, runs = _prefills(model, prompt(2, 70, seed=1), "h2o", {"budget": 24}, monkeypatch)
    if arch in EAGER_ARCHS:
        assert calls == []
    else:
        assert calls and all(calls)
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-5)
    assert runs[0][1] == runs[1][1]
