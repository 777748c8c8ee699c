"""Column sums from the flash kernel's log-sum-exp (``kvsieve.attention.flash_statistics``): a bfloat16, float16 or
float32 causal prompt on the CPU gets SDPA's output bit for bit and the softmax pass's column sums within float32
rounding; every other case is left to the softmax pass; in a model, ``fuse_statistics=True`` then leaves the prompt's
logits exactly those of the unfused prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_ARCHS, EAGER_ARCHS, build_model
from helpers import all_kept_positions, managed_layers, prompt

import kvsieve
from kvsieve.attention import flash_statistics
from kvsieve.attention.flash_statistics import flash_attention_and_column_sums
from kvsieve.attention.kernel import AttentionForm, Visibility, column_sums
from kvsieve.engine.engine import Engine
from kvsieve.native import column_sums as column_sums_native
from kvsieve.native import fused_attention
from kvsieve.native.column_sums import causal_column_sums
from kvsieve.transformers_adapter import cache_kwargs

SCALE = 64**-0.5


def _inputs(q_heads: int, kv_heads: int, n: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = (torch.randn(2, q_heads, n, 64, generator=generator) * 0.5).to(dtype)
    keys = torch.randn(2, kv_heads, n, 64, generator=generator).to(dtype)
    values = torch.randn(2, kv_heads, n, 64, generator=generator).to(dtype)
    positions = torch.arange(n).expand(2, kv_heads, n).contiguous()
    return query, keys, values, Visibility(0, positions)


def _native_sums(query, keys, logsumexp, scaling):
    """The C pass's sums (``kvsieve.native.column_sums``), checked to be taken where it runs."""
    sums = causal_column_sums(query, keys, logsumexp, scaling)
    runs = {torch.bfloat16: column_sums_native.bf16_dot(), torch.float32: fused_attention.vector_code()}
    assert (sums is not None) == runs.get(query.dtype, False)
    return sums


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("native", [False, True], ids=["pytorch-sums", "native-sums"])
def test_output_is_sdpas_and_sums_are_the_softmax_passs(dtype, q_heads, kv_heads, native):
    """The sums from the PyTorch blocks, or from the CPU's C pass where it has one (``native``: bfloat16 dot products
    with AVX512-BF16, float32 with AVX-512 or AVX2; float16 takes the PyTorch blocks): both within the same bound of a
    float64 reference. A float32 prompt's output is SDPA's too, bit for bit."""
    n = 200  # several query blocks (at most 64 rows each)
    query, keys, values, visibility = _inputs(q_heads, kv_heads, n, dtype)
    result = flash_attention_and_column_sums(query, keys, values, visibility, AttentionForm(SCALE), None, None,
                                             _native_sums if native else None)
    assert result is not None
    output, sums = result
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=SCALE,
                                                                enable_gqa=q_heads != kv_heads)
    assert output.dtype == dtype and torch.equal(output, expected.transpose(1, 2))
    softmax_sums = column_sums(query, keys, visibility, SCALE)
    assert sums.dtype == torch.float32 and sums.shape == (2, q_heads, n)
    # float64 reference: every query's softmax row over the keys up to its own position, summed over the queries
    logits = (query.double() @ keys.double().repeat_interleave(q_heads // kv_heads, dim=1).transpose(-1, -2)) * SCALE
    reference = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1).sum(dim=2)
    # the flash kernel's log-sum-exp carries its fast exponential's error: ≤ 5e-5 relative (~2e-5 seen), where the
    # softmax pass stays within 5e-6
    torch.testing.assert_close(sums.double(), reference, rtol=5e-5, atol=1e-7)
    torch.testing.assert_close(softmax_sums.double(), reference, rtol=5e-6, atol=1e-7)


def test_every_other_case_is_left_to_the_softmax_pass():
    query, keys, values, visibility = _inputs(9, 3, 48, torch.bfloat16)
    form = AttentionForm(SCALE)
    positions = visibility.key_positions

    def declines(*, query=query, keys=keys, values=values, visibility=visibility, form=form, weight=None, bias=None):
        return flash_attention_and_column_sums(query, keys, values, visibility, form, weight, bias) is None

    assert not declines()
    assert not declines(query=query.float(), keys=keys.float(), values=values.float())  # float32 too (session 31)
    assert declines(query=query.double(), keys=keys.double(), values=values.double())  # float64: the softmax pass
    assert declines(visibility=Visibility(0, positions, torch.ones(2, 3, 48, dtype=torch.bool)))  # padding
    assert declines(visibility=Visibility(0, positions, None, 16))  # a sliding window
    assert declines(visibility=Visibility(5, positions))  # a continued prompt: its queries start later
    assert declines(visibility=lambda lo, hi: torch.ones(1, 1, hi - lo, 48, dtype=torch.bool))  # an explicit mask
    assert declines(form=AttentionForm(SCALE, softcap=30.0))
    assert declines(form=AttentionForm(SCALE, sinks=torch.zeros(9)))
    assert declines(bias=torch.zeros(2, 3, 48))
    assert declines(weight=torch.ones(2, 48))
    assert declines(keys=keys[:, :, :40], values=values[:, :, :40], visibility=Visibility(0, positions[..., :40]))


def test_without_the_operator_the_softmax_pass_decides(monkeypatch):
    query, keys, values, visibility = _inputs(9, 3, 48, torch.bfloat16)
    monkeypatch.setattr(flash_statistics, "_flash_with_logsumexp", lambda: None)
    assert flash_attention_and_column_sums(query, keys, values, visibility, AttentionForm(SCALE), None, None) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_bf16_prefill_keeps_the_unfused_logits_and_entries(arch, monkeypatch):
    """In a bfloat16 model the fused prefill takes this route: the prompt's logits are the unfused prefill's (SDPA)
    bit for bit, and the kept entries the same."""
    model = build_model(arch).to(torch.bfloat16)
    ids = prompt(1, 90, seed=3)
    taken = []
    original = flash_statistics.flash_attention_and_column_sums

    def spy(*args):
        result = original(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr("kvsieve.core.step.flash_attention_and_column_sums", spy)
    runs = []
    for fused in (True, False):
        cache = kvsieve.KVCache(model, "h2o", budget=24, fuse_statistics=fused)
        logits = model(ids, **cache_kwargs(model, cache)).logits
        cache.flush()
        runs.append((logits, [positions.tolist() for *_, positions in all_kept_positions(cache)]))
    assert taken and all(taken)
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", [arch for arch in ALL_ARCHS if arch not in EAGER_ARCHS])
@pytest.mark.parametrize("policy", ["h2o", "ems"])
def test_default_prefill_takes_the_route_with_the_same_logits(arch, policy, dtype, monkeypatch):
    """Without ``fuse_statistics`` a bfloat16 or float32 prompt that evicts on column sums takes this route too, since
    its output is SDPA's: the prompt's logits equal, bit for bit, those with the route off (SDPA, then the softmax
    pass for the sums), on every architecture SDPA serves, and the same entries are kept."""
    model = build_model(arch).to(dtype)
    ids = prompt(2, 90, seed=5)
    runs, taken = [], []
    original = Engine._flash_statistics

    def spy(self, call, step):
        result = original(self, call, step)
        taken.append(result is not None)
        return result

    for route in (True, False):
        monkeypatch.setattr(Engine, "_flash_statistics", spy if route else (lambda self, call, step: None))
        params = {"window": 8} if policy == "ems" else {}
        cache = kvsieve.KVCache(model, policy, budget=24, **params)
        with torch.inference_mode():
            logits = model(ids, **cache_kwargs(model, cache)).logits
        cache.flush()
        runs.append((logits, [positions.tolist() for *_, positions in all_kept_positions(cache)]))
        if route:  # every full-attention layer took it (a sliding-window layer's prompt is not causal over all)
            assert taken.count(True) == len(managed_layers(cache)) >= 1
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
