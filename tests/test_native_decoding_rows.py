"""The CPU's one-pass decoding output and float32 softmax rows (``kvsieve.native.decoding_rows``): the rows and
``P·V`` of a float64 reference with validity, a per-entry bias and strided views, in every dtype; what a layer that
compacts at every decoding step reads (H2O, TOVA), within rounding of the PyTorch path, and declined where it does
not apply."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from helpers import NATIVE_TOLERANCE, all_kept_positions, decodes_alike, needs_native
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve import KVCache
from kvsieve.core.step import LayerStep
from kvsieve.native import decoding_rows
from kvsieve.native.decoding_rows import attend

pytestmark = needs_native(decoding_rows._kernel)
TOLERANCE = NATIVE_TOLERANCE


def _reference(query, scaling, keys, values, valid, bias):
    """Float64 softmax rows ``(batch, q_heads, 1, L)`` and output ``(batch, 1, q_heads, d)``."""
    batch, q_heads, _, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    rows = q_heads // kv_heads
    q = query.double().view(batch, kv_heads, rows, dim)
    logits = torch.einsum("bhgd,bhld->bhgl", q, keys.double()) * scaling
    if bias is not None:
        logits = logits + bias.double()[:, :, None, :]
    if valid is not None:
        logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgl,bhld->bhgd", probs, values.double().nan_to_num())
    return probs.reshape(batch, q_heads, 1, length), out.reshape(batch, 1, q_heads, dim)


@given(batch=st.integers(1, 3), heads=st.integers(1, 3), rows=st.sampled_from([1, 3, 4]),
       dim=st.sampled_from([16, 64]), length=st.integers(1, 300), padded=st.booleans(), biased=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 99))
@settings(max_examples=80, deadline=None, derandomize=True)
def test_the_rows_and_output_are_softmax_attention(batch, heads, rows, dim, length, padded, biased, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(batch, heads, length + 7, dim, generator=gen).to(dtype)
    keys = buffer[:, :, 3: 3 + length]  # a strided slice of a larger buffer
    values = torch.randn(batch, heads, length + 7, dim, generator=gen).to(dtype)[:, :, 3: 3 + length]
    query = (torch.randn(batch, heads * rows, 1, dim, generator=gen) * 2).to(dtype)
    valid = None
    if padded:
        valid = torch.rand(batch, heads, length, generator=gen) < 0.7
        valid[..., -1] = True  # the newest entry: a decoding query sees at least itself
    bias = torch.rand(batch, heads, length, generator=gen) * 3 if biased else None
    scaling = dim ** -0.5
    result = attend(query, scaling, keys, values, valid, bias)
    assert result is not None
    out, probs = result
    assert out.dtype == dtype and out.shape == (batch, 1, heads * rows, dim)
    assert probs.dtype == torch.float32 and probs.shape == (batch, heads * rows, 1, length)
    expected_probs, expected_out = _reference(query, scaling, keys, values, valid, bias)
    torch.testing.assert_close(probs.double(), expected_probs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.double(), expected_out, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if valid is not None:  # invalid entries: exactly zero probability
        assert bool((probs.view(batch, heads, rows, length)[~valid[:, :, None, :].expand(-1, -1, rows, -1)] == 0).all())


@given(batch=st.integers(1, 3), heads=st.integers(1, 3), rows=st.sampled_from([1, 3]), length=st.integers(1, 200),
       spare=st.integers(0, 9), layout=st.sampled_from(["capacity", "contiguous", "heads_first"]),
       seed=st.integers(0, 99))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_merge_counts_are_read_in_place_as_their_log(batch, heads, rows, length, spare, layout, seed):
    """EMS's merge counts, read where a store keeps them (``(batch, heads, capacity)`` side data narrowed to the held
    entries) or in any other layout, add ``log(max(count, 1))`` to their entries' logits: the rows equal those of the
    bias :func:`count_bias` computes, to an ulp of the logarithm, and the float64 reference."""
    from kvsieve.core.step import count_bias

    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length, 16, generator=gen)
    values = torch.randn(batch, heads, length, 16, generator=gen)
    query = torch.randn(batch, heads * rows, 1, 16, generator=gen) * 2
    whole = torch.randint(0, 40, (batch, heads, length + spare), generator=gen).float()  # 0: counts once
    kind = torch.randint(0, 8, whole.shape, generator=gen)  # the pass's table of whole counts, and past it
    whole = torch.where(kind == 0, whole + 0.25, torch.where(kind == 1, whole + 4090.0, whole))
    counts = whole.narrow(2, 0, length)  # segments `length + spare` apart, as in a store's side data
    if layout == "contiguous":
        counts = counts.contiguous()
    elif layout == "heads_first":  # not evenly spaced rows: read through a contiguous copy
        counts = whole.transpose(0, 1).contiguous().transpose(0, 1).narrow(2, 0, length)
    from_counts = attend(query, 0.25, keys, values, None, counts, counts=True)
    from_bias = attend(query, 0.25, keys, values, None, count_bias(counts))
    assert from_counts is not None and from_bias is not None
    torch.testing.assert_close(from_counts[1], from_bias[1], rtol=3e-6, atol=1e-9)  # a logit an ulp apart
    torch.testing.assert_close(from_counts[0], from_bias[0], rtol=1e-6, atol=1e-7)
    expected_probs, _ = _reference(query, 0.25, keys, values, None, counts.clamp(min=1.0).double().log())
    torch.testing.assert_close(from_counts[1].double(), expected_probs, rtol=1e-5, atol=1e-7)


def test_what_it_does_not_take_is_left_to_the_pytorch_path(monkeypatch):
    query, keys = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 5, 16)
    assert attend(query, 0.25, keys, keys, None, None) is not None
    assert attend(torch.randn(1, 2, 1, 12), 0.25, torch.randn(1, 1, 5, 12), torch.randn(1, 1, 5, 12), None,
                  None) is None  # a head size not a multiple of 8
    assert attend(torch.randn(1, 2, 2, 16), 0.25, keys, keys, None, None) is None  # two queries
    assert attend(torch.randn(1, 17, 1, 16), 0.25, keys, keys, None, None) is None  # 17 query heads per KV head
    assert attend(query, 0.25, keys.double(), keys.double(), None, None) is None  # a dtype it does not read
    assert attend(query, 0.25, keys, keys, torch.ones(1, 1, 4, dtype=torch.bool), None) is None  # a wrong validity
    assert attend(query, 0.25, keys, keys, None, torch.zeros(1, 1, 4)) is None  # a wrong bias
    assert attend(query, 0.25, keys, keys, torch.zeros(1, 1, 5, dtype=torch.bool), None) is None  # sees nothing
    meta = torch.empty(1, 1, 5, 16, device="meta")
    assert attend(query.to("meta"), 0.25, meta, meta, None, None) is None  # off the CPU
    monkeypatch.setattr(decoding_rows, "_kernel", lambda: None)
    assert attend(query, 0.25, keys, keys, None, None) is None  # no built library


@pytest.mark.parametrize("policy", ["h2o", "tova"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_step_eviction_reads_the_pass_close_to_the_pytorch_path(monkeypatch, policy, dtype):
    """Each decoding step of a layer that compacts at every step takes its output and its scorer's row from the pass;
    the logits stay within rounding of the PyTorch path (float32 copies, ``q·k``, softmax, ``P·V``), the greedy tokens
    and the kept positions are the same, and the row the scorer reads is the pass's own."""
    model = build_model("llama").to(dtype)
    prompt = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5))
    taken: list[bool] = []
    real = decoding_rows.attend
    original_output = LayerStep.decoding_output_from_row
    rows_read: list[bool] = []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        taken.append(out is not None)
        return out

    def output_then_rows(self):  # the memoised row is the pass's: no second computation
        output = original_output(self)
        rows_read.append(self._memo[("rows", 1)].data_ptr() == self.window_rows_unchecked(1).data_ptr())
        return output

    monkeypatch.setattr(LayerStep, "decoding_output_from_row", output_then_rows)
    caches = decodes_alike(model, lambda: KVCache(model, policy, budget=16, schedule="decode"), prompt, dtype,
                           lambda on: monkeypatch.setattr(decoding_rows, "attend", spy if on else lambda *a, **k: None))
    assert taken and all(taken), "an every-step compaction did not take the pass"
    assert len(taken) == 4 * model.config.num_hidden_layers
    assert rows_read and all(rows_read)
    native, reference = (list(all_kept_positions(cache)) for cache in caches)
    assert len(native) == len(reference)
    for (*where, kept), (*where_reference, kept_reference) in zip(native, reference, strict=True):
        assert where == where_reference and torch.equal(kept, kept_reference)
