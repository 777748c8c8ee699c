"""A causal prompt's column sums from the flash kernel's log-sum-exp with the CPU's bfloat16 dot products or float32
vector code (``kvsieve.native.column_sums``): a float64 reference over shapes, GQA groups, head sizes, strided views
and lengths that end mid-block, within float32 rounding; declined where it does not apply; in a model, ``h2o`` keeps
the entries the PyTorch sums keep."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from helpers import all_kept_positions, prompt
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsieve
from kvsieve.attention.kernel import _flash_with_logsumexp
from kvsieve.native import column_sums, fused_attention
from kvsieve.native.column_sums import causal_column_sums
from kvsieve.transformers_adapter import cache_kwargs

BF16 = pytest.mark.skipif(not column_sums.bf16_dot(), reason="no C compiler or no AVX512-BF16: the PyTorch blocks only")
F32 = pytest.mark.skipif(not fused_attention.vector_code(),
                         reason="no C compiler, or neither AVX-512 nor AVX2: the PyTorch blocks only")
DTYPES = [pytest.param(torch.bfloat16, marks=BF16, id="bf16"), pytest.param(torch.float32, marks=F32, id="f32")]
#: Head sizes each pass takes: even ones up to 256 (bfloat16 pairs), multiples of 16 (float32 vectors).
DIMS = {torch.bfloat16: [2, 8, 30, 64, 96, 128, 256], torch.float32: [16, 48, 64, 96, 128, 256]}


def _case(batch: int, kv_heads: int, groups: int, n: int, dim: int, seed: int, strided: bool,
          dtype: torch.dtype = torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    q_heads = kv_heads * groups
    if strided:  # (batch, n, heads, d) buffers viewed head-major, as a model's projections are
        query = torch.randn(batch, n, q_heads, dim, generator=generator).to(dtype).transpose(1, 2)
        keys = torch.randn(batch, n, kv_heads, dim, generator=generator).to(dtype).transpose(1, 2)
    else:
        query = torch.randn(batch, q_heads, n, dim, generator=generator).to(dtype)
        keys = torch.randn(batch, kv_heads, n, dim, generator=generator).to(dtype)
    scaling = dim**-0.5
    logits = (query.double() @ keys.double().repeat_interleave(groups, dim=1).transpose(-1, -2)) * scaling
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    logsumexp = torch.logsumexp(logits, dim=-1)
    reference = torch.exp(logits - logsumexp[..., None]).sum(dim=2)
    return query, keys, logsumexp.float(), scaling, reference


@pytest.mark.parametrize("dtype", DTYPES)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), groups=st.sampled_from([1, 2, 3, 4]),
       n=st.integers(1, 300), dim_index=st.integers(0, 5), strided=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=50, deadline=None, derandomize=True)
def test_sums_match_a_float64_reference(dtype, batch, kv_heads, groups, n, dim_index, strided, seed):
    dim = DIMS[dtype][dim_index]
    query, keys, logsumexp, scaling, reference = _case(batch, kv_heads, groups, n, dim, seed, strided, dtype)
    sums = causal_column_sums(query, keys, logsumexp, scaling)
    assert sums is not None and sums.dtype == torch.float32 and sums.shape == reference.shape
    # the log-sum-exp is exact here (float64, rounded once): what is left is float32 rounding and the exp polynomial
    torch.testing.assert_close(sums.double(), reference, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "dim"), [(300, 64), (1000, 64), (777, 128), (200, 256), (150, 96)])
def test_long_prompt_in_parallel_blocks(n, dim, dtype):
    """Prompts past the parallel threshold (256 entries) and over several spans of the tiles (128 keys), the last
    span and block partly filled; head sizes of one to eight chunks of 32."""
    query, keys, logsumexp, scaling, reference = _case(1, 3, 3, n, dim, 7, True, dtype)
    torch.testing.assert_close(causal_column_sums(query, keys, logsumexp, scaling).double(), reference,
                               rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["float16", "mixed", "dim_not_taken", "wide_dim", "keys_strided_dim", "groups",
                                  "logsumexp_shape", "logsumexp_dtype"])
def test_declined(case, dtype):
    query, keys, logsumexp, scaling, _ = _case(1, 2, 2, 20, 16, 0, False, dtype)
    assert causal_column_sums(query, keys, logsumexp, scaling) is not None
    if case == "float16":
        query, keys = query.half(), keys.half()
    elif case == "mixed":
        query = query.float() if dtype == torch.bfloat16 else query.bfloat16()
    elif case == "dim_not_taken":  # bfloat16 pairs take even head sizes, float32 vectors multiples of 16
        width = 7 if dtype == torch.bfloat16 else 8
        query, keys = query[..., :width], keys[..., :width]
    elif case == "wide_dim":
        query, keys = query.repeat(1, 1, 1, 17), keys.repeat(1, 1, 1, 17)
    elif case == "keys_strided_dim":
        keys = keys.transpose(-1, -2).contiguous().transpose(-1, -2)  # no unit stride over d
    elif case == "groups":
        keys = keys[:, :1].expand(1, 3, 20, 16)
    elif case == "logsumexp_shape":
        logsumexp = logsumexp[..., :-1]
    else:
        logsumexp = logsumexp.double()
    assert causal_column_sums(query, keys, logsumexp, scaling) is None


@pytest.mark.skipif(_flash_with_logsumexp() is None, reason="this torch has no flash kernel with log-sum-exp")
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_h2o_prefill_keeps_what_the_pytorch_sums_keep(dtype, monkeypatch):
    """A bfloat16 or float32 model's h2o prefill takes the pass's sums: the kept entries are the PyTorch sums' (the
    sums differ by float32 rounding only), and the pass ran. (The float32 model's head size, 16, is one the pass
    takes; with ``fuse_statistics`` a float32 prompt would take the fused pass instead, so its prefill is the
    default one.)"""
    model = build_model("llama").to(dtype)
    ids = prompt(1, 120, seed=4)
    calls: list[bool] = []

    def kept(native: bool) -> list:
        def spy(*args):
            out = causal_column_sums(*args) if native else None
            calls.append(out is not None)
            return out

        monkeypatch.setattr("kvsieve.core.step.causal_column_sums", spy)
        cache = kvsieve.KVCache(model, "h2o", budget=32, fuse_statistics=dtype == torch.bfloat16)
        with torch.inference_mode():
            model(ids, **cache_kwargs(model, cache))
        cache.flush()
        return [positions.tolist() for *_, positions in all_kept_positions(cache)]

    assert kept(True) == kept(False)
    assert calls[: len(calls) // 2] and all(calls[: len(calls) // 2])
