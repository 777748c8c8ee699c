"""kvsieve's C dequantization pass (``kvsieve.native``): bit for bit the PyTorch path it replaces on the CPU, writes
nothing outside its slice of the view, is used by a mixed-precision decoding step, and steps aside cleanly where it
cannot be built."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_model
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsieve
from kvsieve import KVCache
from kvsieve.cache.quantized_tier import QuantizedTier
from kvsieve.cache.store_tiers import StoreTiers
from kvsieve.native import build
from kvsieve.native import dequantize as native_dequantize

HAS_COMPILER = any(shutil.which(name) for name in ("cc", "gcc", "clang"))
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler: the PyTorch path is the only one")


def test_the_pass_is_built_where_a_compiler_is():
    assert native_dequantize.available(), "a C compiler is installed but kvsieve.native did not build tiers.c"


def test_the_build_says_whether_its_attention_passes_run():
    """``build.vector_code()`` (what the attention passes' tests skip on) is whether a pass takes a plain decoding
    query: True on a CPU with AVX2/FMA/F16C, False elsewhere (the passes always decline there)."""
    from kvsieve.native import build, segment_attention

    keys = torch.randn(8, 16)
    out = segment_attention.attend(torch.randn(1, 2, 1, 16), 0.25, keys, keys, torch.tensor([0]), torch.tensor([8]))
    assert build.vector_code() == (out is not None)
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    if all(flag in flags.split() for flag in ("avx2", "fma", "f16c")):
        assert build.vector_code()


def _tier(counts: list[int], bits: int, group: int, value_group: int, dim: int, dtype: torch.dtype, seed: int,
          heads: int = 2) -> QuantizedTier:
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    keys = torch.randn(n, dim, generator=gen) * 3
    keys[:, 1] += 20  # an outlier channel
    values = torch.randn(n, dim, generator=gen)
    positions = torch.cat([torch.arange(c) for c in counts]) if n else torch.zeros(0, dtype=torch.long)
    tier = QuantizedTier(len(counts) // heads, heads, dim, bits, group, value_group, dtype, torch.device("cpu"))
    tier.add(keys.to(dtype), values.to(dtype), positions, torch.tensor(counts))
    return tier


@given(counts=st.lists(st.integers(0, 40), min_size=4, max_size=4).filter(lambda c: sum(c) > 0),
       bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([1, 4, 32]), split=st.sampled_from([1, 2, 4]),
       dim=st.sampled_from([12, 16, 64, 80]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 99), drop=st.booleans())
@settings(max_examples=60, deadline=None, derandomize=True)
def test_attention_parts_are_the_pytorch_paths_bit_for_bit(counts, bits, group, split, dim, dtype, seed, drop):
    """Ragged segments (a gather index) or even ones (none), removed slots, every bit width and view dtype, written
    into a slice of a larger view: the same bits as the PyTorch path, and the rest of the view untouched. Head sizes
    and value groups that are multiples of 8 take the C pass's vector loop where the CPU has AVX2, the others its
    plain loop (12, and value groups of 3, 4, 6)."""
    tier = _tier(counts, bits, group, dim // split, dim, dtype, seed)
    if drop:  # remove every third slot: invalid slots and freed groups
        _, _, positions, _ = tier.dense()
        keep = torch.ones(positions.shape, dtype=torch.bool)
        keep[..., ::3] = False
        tier.keep(keep)
    if tier.empty:
        return
    index, positions, _ = tier.attention_layout()
    shape = (tier.batch, tier.heads, positions.shape[2] + 5, dim)
    views = {}
    for native in (True, False):
        keys, values = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, -7.0, dtype=dtype)
        window = slice(3, 3 + positions.shape[2])
        tier.dequantized(index, (keys[:, :, window], values[:, :, window]), native=native)
        views[native] = keys, values
    assert torch.equal(views[True][0], views[False][0])
    assert torch.equal(views[True][1], views[False][1])
    # and without a view to write into (the dense layout's own tensors)
    got, expected = tier.dequantized(index), tier.dequantized(index, native=False)
    assert got[0].dtype == expected[0].dtype == dtype
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_the_pass_writes_what_the_recipe_says():
    """Independently of the PyTorch path: a 2-bit group's keys are ``minimum + code·step`` per channel."""
    tier = _tier([4, 0], bits=2, group=4, value_group=8, dim=8, dtype=torch.float32, seed=1, heads=1)
    keys, _ = tier.dequantized()
    codes = torch.stack([(tier.key_codes[0, :, :] >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1).reshape(4, 8)
    step, minimum = tier.key_params[0].float()
    assert torch.equal(keys[0], minimum + codes.float() * step)


def test_arguments_it_does_not_take_are_left_to_the_pytorch_path():
    tier = _tier([8, 8], bits=4, group=4, value_group=8, dim=16, dtype=torch.float32, seed=0, heads=1)
    out = torch.zeros(2, 1, 8, 16), torch.zeros(2, 1, 8, 16)
    args = (tier.bits, tier.group, tier.value_group, tier.key_codes, tier.key_params, tier.value_codes,
            tier.value_params, None)
    assert native_dequantize.dequantize_into(*args, *out)
    assert not native_dequantize.dequantize_into(*args, out[0].double(), out[1].double())  # a dtype it does not write
    assert not native_dequantize.dequantize_into(*args, out[0].transpose(2, 3), out[1].transpose(2, 3))  # strided d
    assert not native_dequantize.dequantize_into(*args, out[0][:, :, :4], out[1][:, :, :4])  # too few slots
    meta = torch.empty(2, 1, 8, 16, device="meta"), torch.empty(2, 1, 8, 16, device="meta")
    assert not native_dequantize.dequantize_into(*args, *meta)  # off the CPU


def test_a_failed_build_leaves_the_pytorch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    build.load.cache_clear()
    try:
        with caplog.at_level("INFO", logger="kvsieve.native"):
            assert build.load("tiers") is None
        assert "not built" in caplog.text
        monkeypatch.setenv("KVSIEVE_NATIVE", "0")
        monkeypatch.delenv("CC")
        build.load.cache_clear()
        assert build.load("tiers") is None
        assert not list(tmp_path.rglob("*.so"))
    finally:
        build.load.cache_clear()
    # with no library the tier still reads back, through the PyTorch path
    monkeypatch.setattr(native_dequantize, "_kernel", lambda: None)
    tier = _tier([5, 9], bits=2, group=4, value_group=8, dim=16, dtype=torch.bfloat16, seed=2, heads=1)
    got, expected = tier.dequantized(), tier.dequantized(native=False)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_a_build_is_made_once_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path))
    build.load.cache_clear()
    try:
        assert build.load("tiers") is not None
        built = list((tmp_path / "native").glob("tiers-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        build.load.cache_clear()
        assert build.load("tiers") is not None
        assert [p.stat().st_mtime_ns for p in (tmp_path / "native").glob("tiers-*.so")] == [stamp]
        assert not list((tmp_path / "native").glob(".*.tmp"))
    finally:
        build.load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_cache_decodes_through_the_pass_as_through_the_pytorch_path(monkeypatch, dtype):
    """The same logits at every step with the C pass and without it, and the pass is what the step used (with the
    attention over packed tiers, ``kvsieve.native.tiered_attention``, off: it reads the codes without dequantizing)."""
    monkeypatch.setattr(StoreTiers, "decoding_output", lambda self, query, scaling: None)
    model = build_model("llama").to(dtype)
    prompt = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    calls = []
    real = native_dequantize.dequantize_into

    def counted(*args, **kwargs):
        done = real(*args, **kwargs)
        calls.append(done)
        return done

    logits = {}
    for native in (True, False):
        if native:
            monkeypatch.setattr("kvsieve.cache.quantized_tier.dequantize_into", counted)
        else:
            monkeypatch.setattr("kvsieve.cache.quantized_tier.dequantize_into", lambda *a, **k: False)
        cache = KVCache(model, "mixed", budget=16, window=2, group=4, value_group=8)
        with torch.no_grad():
            out = model(prompt, **kvsieve.cache_kwargs(model, cache), use_cache=True)
            steps = [out.logits[:, -1]]
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(4):
                out = model(token, **kvsieve.cache_kwargs(model, cache), use_cache=True)
                steps.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
        logits[native] = torch.stack(steps)
    assert calls and all(calls), "the mixed cache's decoding steps did not take the C pass"
    assert torch.equal(logits[True], logits[False])


@given(counts=st.lists(st.integers(0, 40), min_size=4, max_size=4).filter(lambda c: sum(c) > 0),
       bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([1, 4, 32]), split=st.sampled_from([1, 2, 4]),
       dim=st.sampled_from([10, 12, 16, 64]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 99), flat=st.booleans())
@settings(max_examples=60, deadline=None, derandomize=True)
def test_new_groups_are_quantized_as_the_pytorch_path_quantizes_them(counts, bits, group, split, dim, dtype, seed,
                                                                      flat):
    """``QuantizedTier.add`` through the C pass (``kvsieve.native.quantize``) and through PyTorch: the same packed
    codes and the same float16 steps and minimums, bit for bit — partial groups, head sizes whose codes do not fill the
    last byte (10), constant channels (``flat``: a zero range, step 0), values up to ~1e4."""
    if dim % split:
        return
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    keys = torch.randn(n, dim, generator=gen) * torch.logspace(-2, 4, dim)
    values = torch.randn(n, dim, generator=gen) * 3
    if flat:
        keys[:, 0] = 1.5
        values[: n // 2] = -0.25
    positions = torch.cat([torch.arange(c) for c in counts])
    tiers = []
    for native in (True, False):
        tier = QuantizedTier(2, 2, dim, bits, group, dim // split, dtype, torch.device("cpu"))
        tier.add(keys.to(dtype), values.to(dtype), positions, torch.tensor(counts), native=native)
        tiers.append(tier)
    for name in ("key_codes", "value_codes", "positions", "valid"):
        assert torch.equal(getattr(tiers[0], name), getattr(tiers[1], name)), name
    for name in ("key_params", "value_params"):
        assert torch.equal(getattr(tiers[0], name).view(torch.int16), getattr(tiers[1], name).view(torch.int16)), name
