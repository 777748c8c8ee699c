"""The CPU's decoding attention over a ragged layer read in place (``kvsieve.native.segment_attention``): the softmax
attention of each query head over its KV head's rows (float64 reference) for any mix of lengths, any segment order
and slack, long heads cut into units and folded; taken by every ragged decoding step of a model on the CPU, within
rounding of the PyTorch path, and declined where it does not apply."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from helpers import NATIVE_TOLERANCE, decodes_alike, needs_native, random_pattern
from hypothesis import given, settings
from hypothesis import strategies as st
from test_row_independence import CharTokenizer

import kvsieve
from kvsieve import KVCache
from kvsieve.native import segment_attention
from kvsieve.native.segment_attention import attend

pytestmark = needs_native(segment_attention._kernel)
TOLERANCE = NATIVE_TOLERANCE


def _reference(query, scaling, keys, values, start, length):
    """Float64 softmax attention of each segment's query rows over its rows ``start[s] … start[s] + length[s]``."""
    batch, q_heads, _, dim = query.shape
    segments = start.numel()
    heads = segments // batch
    rows = q_heads // heads
    out = torch.empty(batch, 1, q_heads, dim, dtype=torch.float64)
    for s in range(segments):
        b, h = divmod(s, heads)
        k = keys[start[s]: start[s] + length[s]].double()
        v = values[start[s]: start[s] + length[s]].double()
        q = query[b, h * rows: (h + 1) * rows, 0].double()
        out[b, 0, h * rows: (h + 1) * rows] = torch.softmax(q @ k.T * scaling, dim=-1) @ v
    return out


@given(batch=st.integers(1, 3), heads=st.integers(1, 3), rows=st.sampled_from([1, 3, 4]),
       dim=st.sampled_from([16, 64]), long=st.integers(0, 1300), extra=st.integers(0, 2),
       chunk=st.sampled_from([1, 7, 64, 512]), parallel=st.booleans(), shuffled=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 99))
@settings(max_examples=80, deadline=None, derandomize=True)
def test_the_output_is_softmax_attention_over_each_segments_rows(batch, heads, rows, dim, long, extra, chunk,
                                                                 parallel, shuffled, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    segments = batch * heads
    held = torch.randint(3, 40, (segments,), generator=gen)
    held[int(torch.randint(0, segments, (1,), generator=gen))] += long  # one long head beside short ones
    length = held - extra  # what the layout's tensor says; ``extra`` decoding appends since
    slack = torch.randint(0, 5, (segments,), generator=gen)
    order = torch.randperm(segments, generator=gen) if shuffled else torch.arange(segments)  # segments in run order
    start = torch.zeros(segments, dtype=torch.long)
    row = 0
    for s in order.tolist():
        start[s] = row
        row += int(held[s] + slack[s])
    keys = (torch.randn(row, dim, generator=gen) * 2).to(dtype)
    values = torch.randn(row, dim, generator=gen).to(dtype)
    query = (torch.randn(batch, heads * rows, 1, dim, generator=gen) * 2).to(dtype)
    scaling = dim ** -0.5
    out = attend(query, scaling, keys, values, start, length, extra, chunk=chunk,
                 parallel_from=0 if parallel else 1 << 40)
    assert out is not None and out.dtype == dtype and out.shape == (batch, 1, heads * rows, dim)
    expected = _reference(query, scaling, keys, values, start, held)
    torch.testing.assert_close(out.double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_rows_outside_a_segment_have_no_weight_whatever_they_hold():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(30, 16, generator=gen), torch.randn(30, 16, generator=gen)
    start, length = torch.tensor([2, 17]), torch.tensor([9, 11])
    query = torch.randn(1, 4, 1, 16, generator=gen)
    expected = attend(query, 0.25, keys, values, start, length)
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    for rows in (slice(0, 2), slice(11, 17), slice(28, 30)):  # slack and the rows before and after
        poisoned_keys[rows], poisoned_values[rows] = 1e4, float("nan")
    got = attend(query, 0.25, poisoned_keys, poisoned_values, start, length)
    assert got is not None and expected is not None
    assert torch.equal(got, expected)


def test_a_long_head_cut_into_units_is_the_same_attention():
    """Units of 1, 100 or 4,096 entries, on one thread or shared: the same output within float32 rounding."""
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(3000, 64, generator=gen), torch.randn(3000, 64, generator=gen)
    start, length = torch.tensor([0, 2990, 2995]), torch.tensor([2990, 5, 5])
    query = torch.randn(1, 9, 1, 64, generator=gen)
    whole = attend(query, 0.125, keys, values, start, length, chunk=4096, parallel_from=1 << 40)
    assert whole is not None
    for chunk, parallel_from in ((1, 0), (100, 0), (100, 1 << 40)):
        got = attend(query, 0.125, keys, values, start, length, chunk=chunk, parallel_from=parallel_from)
        assert got is not None
        torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-6)


def test_what_it_does_not_take_is_left_to_the_pytorch_path(monkeypatch):
    keys = torch.randn(10, 16)
    start, length = torch.tensor([0, 5]), torch.tensor([5, 5])
    query = torch.randn(1, 4, 1, 16)
    assert attend(query, 0.25, keys, keys, start, length) is not None
    assert attend(torch.randn(1, 4, 1, 12), 0.25, torch.randn(10, 12), torch.randn(10, 12), start,
                  length) is None  # a head size not a multiple of 8
    assert attend(torch.randn(1, 4, 2, 16), 0.25, keys, keys, start, length) is None  # two queries
    assert attend(torch.randn(1, 34, 1, 16), 0.25, keys, keys, start, length) is None  # 17 query heads per KV head
    assert attend(torch.randn(1, 3, 1, 16), 0.25, keys, keys, start, length) is None  # heads that do not divide
    assert attend(query, 0.25, keys.double(), keys.double(), start, length) is None  # a dtype it does not read
    assert attend(query, 0.25, keys.t().contiguous().t(), keys, start, length) is None  # not contiguous rows
    assert attend(query, 0.25, keys, keys, start.int(), length) is None  # not int64 bookkeeping
    assert attend(query, 0.25, keys, keys, start, torch.tensor([5, 0])) is None  # an empty segment
    meta = torch.empty(10, 16, device="meta")
    assert attend(query.to("meta"), 0.25, meta, meta, start, length) is None  # off the CPU
    monkeypatch.setattr(segment_attention, "_kernel", lambda: None)
    assert attend(query, 0.25, keys, keys, start, length) is None  # no built library


@pytest.mark.parametrize("policy,params", [
    ("adakv", {"budget": 12, "window": 4}),
    ("kvzip", {"budget": 10}),
    ("duo_attention", {"budget": 12, "sinks": 2}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_caches_decode_through_the_pass_close_to_the_pytorch_path(monkeypatch, policy, params, dtype):
    """Every decoding step of a ragged layer takes the pass; the logits stay within rounding of the PyTorch path's
    (length groups, strided runs or the padded view) and the greedy tokens are the same."""
    model = build_model("llama").to(dtype)
    prompt = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
    taken: list[bool] = []
    real = segment_attention.attend

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        taken.append(out is not None)
        return out

    if policy == "duo_attention":
        params = {**params, "pattern": random_pattern(model)}
    decodes_alike(model, lambda: KVCache(model, policy, **params), prompt, dtype,
                  lambda on: monkeypatch.setattr(segment_attention, "attend", spy if on else lambda *a, **k: None),
                  # KVzip's scores come from its reconstruction pass
                  (lambda cache: kvsieve.reconstruct(model, CharTokenizer(), cache, prompt)) if policy == "kvzip"
                  else None)
    assert taken and all(taken), "a ragged decoding step did not take the pass"
