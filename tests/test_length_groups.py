"""Decoding over ragged heads by length group: the plan, and the same attention as the padded view."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from helpers import prompt, random_pattern
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsieve
from kvsieve.attention import kernel
from kvsieve.attention.kernel import split_decoding_attention
from kvsieve.cache import length_groups, store_compaction
from kvsieve.cache.length_groups import MAX_GROUPS, MIN_SAVING, plan_groups
from kvsieve.cache.store import LayerStore
from kvsieve.core.step import LayerStep
from kvsieve.engine.attention_output import all_entries_output
from kvsieve.engine.grouped_decode import grouped_decode_output
from kvsieve.models.architectures import ArchitectureSpec, ModelInfo
from kvsieve.native import segment_attention
from kvsieve.transformers_adapter import cache_kwargs

#: These tests check the PyTorch routes of ragged decoding (a GPU's, or a CPU's without the C pass).
pytestmark = pytest.mark.usefixtures("pytorch_ragged_decoding")


def test_a_long_head_among_short_ones_is_its_own_group():
    runs = plan_groups(torch.tensor([37, 4096, 37, 40, 4096, 36]))
    assert runs is not None
    members = [sorted(r[0].tolist()) for r in runs]
    assert members == [[0, 2, 3, 5], [1, 4]]
    assert [r[1] for r in runs] == [40, 4096] and [r[2] for r in runs] == [False, True]


def test_similar_lengths_keep_one_padded_view():
    assert plan_groups(torch.tensor([128, 130, 125, 129])) is None
    assert plan_groups(torch.tensor([3000, 2000])) is None  # a saving below one more call's cost
    assert plan_groups(torch.tensor([7])) is None


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 6000), min_size=2, max_size=24))
def test_plan_covers_every_segment_once_and_saves_padding(lengths):
    runs = plan_groups(torch.tensor(lengths))
    if runs is None:
        return
    assert 2 <= len(runs) <= MAX_GROUPS
    seen = torch.cat([members for members, _, _ in runs]).tolist()
    assert sorted(seen) == list(range(len(lengths)))
    padded = 0
    for members, longest, equal in runs:
        own = [lengths[i] for i in members.tolist()]
        assert longest == max(own) and equal == (min(own) == max(own))
        padded += len(own) * longest
    assert padded <= (1 - MIN_SAVING) * len(lengths) * max(lengths)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=9))
def test_partitions_hold_the_fewest_padded_slots_for_each_number_of_runs(lengths):
    """Against every cut of the sorted lengths into ``g`` contiguous runs (brute force)."""
    from itertools import combinations

    cuts = length_groups.partitions(torch.tensor(lengths))
    ordered = sorted(lengths)
    assert sorted(cuts) == list(range(1, min(MAX_GROUPS, len(lengths)) + 1))
    for g, (slots, runs) in cuts.items():
        brute = min(sum((b - a) * ordered[b - 1] for a, b in zip((0, *bounds), (*bounds, len(ordered)), strict=True))
                    for bounds in combinations(range(1, len(ordered)), g - 1))
        assert slots == brute and len(runs) == g
        assert sorted(torch.cat([members for members, _, _ in runs]).tolist()) == list(range(len(lengths)))
        assert slots == sum(members.numel() * longest for members, longest, _ in runs)
        for members, longest, equal in runs:
            own = [lengths[i] for i in members.tolist()]
            assert longest == max(own) and equal == (min(own) == max(own))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=length_groups.SMALL_PARTITION),
       st.sampled_from([1, 7, 150]))
def test_small_partitions_on_python_ints_equal_the_tensor_programme(lengths, scale):
    """Up to ``SMALL_PARTITION`` segments the programme runs on Python ints: the same slots, runs, members (in the same
    stable order), longest and equal flags as the tensor programme, ties included (small values repeat often)."""
    counts = torch.tensor(lengths) * scale
    small, tensors = length_groups._small_partitions(counts), length_groups._tensor_partitions(counts)
    assert sorted(small) == sorted(tensors)
    for g, (slots, runs) in tensors.items():
        assert small[g][0] == slots and len(small[g][1]) == len(runs)
        for (members, longest, equal), (twin, twin_longest, twin_equal) in zip(small[g][1], runs, strict=True):
            assert torch.equal(members, twin) and longest == twin_longest and equal == twin_equal


def ragged_decoding_step(batch: int, kv_heads: int, groups: int, lengths: list[int], seed: int = 0,
                         strided: bool = False) -> LayerStep:
    """A decoding step of a store whose segments hold ``lengths`` entries (then one more, appended in place); the
    compaction lays them out compact (each group gathered at decoding) unless ``strided`` (its strided runs, when
    :meth:`~kvsieve.cache.store_compaction.StoreCompaction.plan_runs` finds them)."""
    dim = 8
    generator = torch.Generator().manual_seed(seed)
    total = max(lengths)
    store = LayerStore(batch, kv_heads, dim, torch.float32, torch.device("cpu"))
    if not strided:
        store.plan_runs = lambda counts: None  # type: ignore[method-assign]
    store.append(torch.randn(batch, kv_heads, total, dim, generator=generator),
                 torch.randn(batch, kv_heads, total, dim, generator=generator), 0, None)
    local = torch.zeros(batch * kv_heads, total, dtype=torch.long)
    for s, n in enumerate(lengths):  # keep a spread of positions, not just a prefix
        local[s, :n] = torch.linspace(0, total - 1, n).round().long() if n > 1 else torch.tensor([total - 1])
    store.keep(local, torch.tensor(lengths))
    for position in (total, total + 1):  # the second step is written in place (the decoding path)
        store.append(torch.randn(batch, kv_heads, 1, dim, generator=generator),
                     torch.randn(batch, kv_heads, 1, dim, generator=generator), position, None)
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=generator)
    info = ModelInfo(ArchitectureSpec(), 1, kv_heads * groups, kv_heads, dim, (None,))
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    return LayerStep(module=module, layer_idx=0, info=info, query=query, first_position=total + 1,
                     query_valid=None, store=store, scaling=dim**-0.5)


@pytest.mark.parametrize(("batch", "kv_heads", "groups", "lengths"), [
    (1, 3, 3, [300, 5, 6]),
    (1, 3, 3, [5, 6, 300]),  # strided: runs in segment order (no reordering)
    (2, 2, 2, [5, 400, 400, 7]),
    (2, 3, 1, [50, 1, 900, 900, 3, 60]),
])
@pytest.mark.parametrize("strided", [False, True])
def test_grouped_attention_equals_the_padded_view(monkeypatch, batch, kv_heads, groups, lengths, strided):
    """Gathered groups (a compact layout) or strided runs viewed in place: the padded view's attention."""
    monkeypatch.setattr(length_groups, "CALL_COST", 1)
    monkeypatch.setattr("kvsieve.cache.store_compaction.MAX_PADDING", 10.0)
    step = ragged_decoding_step(batch, kv_heads, groups, lengths, strided=strided)
    planned = step.store.length_groups()
    assert planned is not None and len(planned) >= 2
    assert (step.store.runs is not None) == strided
    assert all((group.base is not None) == strided for group, _ in planned)
    grouped = grouped_decode_output(step.store, step.query, step.scaling, planned)
    padded = all_entries_output(step, step.module, None, None, step.view)  # the padded view, explicitly
    torch.testing.assert_close(grouped, padded, atol=1e-6, rtol=1e-5)
    assert torch.equal(all_entries_output(step, step.module, None, None), grouped)  # the engine's choice
    monkeypatch.undo()  # on the CPU with the C pass built, the engine reads each segment's rows in one call instead
    if segment_attention._kernel() is not None:
        native = all_entries_output(step, step.module, None, None)
        assert not torch.equal(native, grouped)  # the pass, not a PyTorch route
        torch.testing.assert_close(native, padded, atol=1e-6, rtol=1e-5)


def test_strided_runs_views_follow_the_buffers_when_they_grow():
    """The runs' views are built once per layout and buffers (``StoreLayout.run_views``): decoding until the slack
    runs out moves every segment into larger buffers, and the step then reads the new buffers (the padded view's
    attention at every step; the views alias the store's buffers)."""
    from kvsieve.cache.store_append import GROWTH

    step = ragged_decoding_step(1, 3, 3, [300, 5, 6], strided=True)
    store = step.store
    generator = torch.Generator().manual_seed(1)
    grown = False
    for position in range(302, 302 + GROWTH + 2):
        planned = store.length_groups()
        assert planned is not None and store.runs is not None
        before = store.keys
        torch.testing.assert_close(grouped_decode_output(step.store, step.query, step.scaling, planned),
                                   all_entries_output(step, step.module, None, None, store.dense()),
                                   atol=1e-6, rtol=1e-5)
        views = store.run_views()
        assert all(view.untyped_storage().data_ptr() == store.keys.untyped_storage().data_ptr()
                   for view in views.keys)
        store.append(torch.randn(1, 3, 1, 8, generator=generator), torch.randn(1, 3, 1, 8, generator=generator),
                     position, None)
        grown = grown or store.keys is not before
    assert grown


@pytest.mark.parametrize(("batch", "kv_heads", "lengths"), [
    (1, 3, [5, 6, 300]),
    (1, 3, [300, 5, 6]),  # runs out of segment order
    (1, 4, [400, 3, 7, 400]),
    (2, 3, [5, 6, 300, 300, 6, 5]),  # six segments: one call per run
])
def test_strided_runs_of_few_segments_are_attended_in_one_masked_call(monkeypatch, batch, kv_heads, lengths):
    """At batch 1 on a CPU (at most ``ONE_CALL_SEGMENTS`` segments) a layout cut into strided runs is attended in one
    SDPA call over its whole buffer, every query row masked to its own segment's held entries (slack and the other
    segments' rows: −inf): the padded view's attention. With more segments, one call per run, as before."""
    monkeypatch.setattr(length_groups, "CALL_COST", 1)
    monkeypatch.setattr(store_compaction, "MAX_PADDING", 10.0)
    groups = 3
    step = ragged_decoding_step(batch, kv_heads, groups, lengths, strided=True)
    store = step.store
    planned = store.length_groups()
    assert planned is not None and store.runs is not None and len(planned) >= 2
    sdpa = torch.nn.functional.scaled_dot_product_attention
    masks: list[torch.Tensor | None] = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: masks.append(k.get("attn_mask")) or sdpa(*a, **k))
    grouped = grouped_decode_output(store, step.query, step.scaling, planned)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    one_call = batch * kv_heads <= length_groups.ONE_CALL_SEGMENTS
    assert len(masks) == (1 if one_call else len(planned))
    if one_call:
        mask = masks[0]
        assert mask is not None and mask.shape == (1, 1, batch * kv_heads * groups, store.keys.shape[0])
        held = torch.isfinite(mask[0, 0]).sum(dim=1)  # each query row sees exactly its segment's entries
        assert held.tolist() == [n + 2 for n in lengths for _ in range(groups)]
    padded = all_entries_output(step, step.module, None, None, step.view)
    torch.testing.assert_close(grouped, padded, atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(length_groups, "ONE_CALL_SEGMENTS", 0)  # the runs' calls: the same attention
    torch.testing.assert_close(grouped_decode_output(store, step.query, step.scaling, planned), grouped,
                               atol=1e-6, rtol=1e-5)


def test_the_one_call_mask_follows_the_appends_and_the_buffers_and_counts_in_the_bytes():
    """The one-call mask is built once per layout and buffers and kept by decoding appends in place (at every step,
    the mask built afresh from the layout), rebuilt when the slack runs out and the segments move into larger
    buffers, and counted in the store's bytes."""
    from kvsieve.cache.store_append import GROWTH

    step = ragged_decoding_step(1, 3, 3, [300, 5, 6], strided=True)
    store = step.store
    first, buffers = store.one_call_mask(3), store.keys
    assert store.one_call_mask(3) is first and store.nbytes() >= first.nbytes + store.keys.nbytes
    generator = torch.Generator().manual_seed(2)
    for position in range(302, 302 + GROWTH + 2):
        store.append(torch.randn(1, 3, 1, 8, generator=generator), torch.randn(1, 3, 1, 8, generator=generator),
                     position, None)
        kept = store.one_call_mask(3)
        store._one_call_mask = None  # the same mask built from the layout now
        assert torch.equal(store.one_call_mask(3), kept)
        assert torch.equal(torch.isfinite(kept[::3]).sum(dim=1), store.length)
    assert store.runs is not None and store.keys is not buffers
    assert store.one_call_mask(3).shape == (9, store.keys.shape[0])


def greedy_step_logits(model: torch.nn.Module, cache: kvsieve.KVCache, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Prefill ``ids``, then ``steps`` greedy decoding steps: the last logits of each step, stacked."""
    logits = []
    with torch.inference_mode():
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(token, **cache_kwargs(model, cache), use_cache=True)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits)


def test_duo_attention_decodes_the_same_with_and_without_length_groups(monkeypatch):
    model = build_model("llama")
    pattern = random_pattern(model, seed=4)
    ids = prompt(2, 48, seed=7)
    outputs = []
    for cost in (1, 10**9):  # grouped on every layer with a long and a short head / never (nor runs for compact)
        monkeypatch.setattr(length_groups, "CALL_COST", cost)
        monkeypatch.setattr(store_compaction, "compact_step_cost",
                            length_groups.compact_step_cost if cost == 1 else lambda *args: None)
        cache = kvsieve.KVCache(model, "duo_attention", budget=10, sinks=2, pattern=pattern, schedule="decode")
        logits = greedy_step_logits(model, cache, ids, 6)
        grouped_layers = sum(layer.store.length_groups() is not None for layer in cache.layers
                             if layer.store is not None)
        outputs.append((logits, grouped_layers))
    (grouped, used), (padded, unused) = outputs
    assert used > 0 and unused == 0
    torch.testing.assert_close(grouped, padded, atol=1e-5, rtol=1e-5)


def test_a_cut_is_cheap_on_a_cpu_and_dear_on_an_accelerator():
    lengths = torch.tensor([1600, 40, 40])  # 2.0× faster grouped on the CPU it was measured on
    assert length_groups.call_cost(torch.device("cpu")) == length_groups.CALL_COST
    assert plan_groups(lengths, length_groups.call_cost(torch.device("cpu"))) is not None
    assert plan_groups(lengths, length_groups.call_cost(torch.device("cuda"))) is None


def test_long_heads_are_attended_in_place_and_as_the_padded_view(monkeypatch):
    step = ragged_decoding_step(2, 2, 2, [5, 690, 700, 7])
    planned = step.store.length_groups()
    assert planned is not None
    assert sorted(sorted(group.segments.tolist()) for group, _ in planned) == [[0, 3], [1, 2]]
    padded = all_entries_output(step, step.module, None, None, step.view)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for in_place, expected_calls in ((600, 3), (10**9, 2)):  # the long pair read in place, or gathered
        calls = []
        monkeypatch.setattr(length_groups, "IN_PLACE_LENGTH", in_place)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *a, calls=calls, **k: calls.append(1) or sdpa(*a, **k))
        grouped = grouped_decode_output(step.store, step.query, step.scaling, planned)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        assert len(calls) == expected_calls
        torch.testing.assert_close(grouped, padded, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "threads"), [(4096, 2), (4099, 2), (5000, 3), (2047, 2), (4096, 1)])
def test_a_long_head_split_across_threads_is_the_one_call_attention(dtype, n, threads, monkeypatch):
    """:func:`split_decoding_attention`: equal runs as batch items of one call plus the leftover entries, combined
    by their log-sum-exps, give one call's attention (float32: 1e-6; bfloat16: the error of one call's own
    output against float64); below the length, or with one thread, it declines (None)."""
    monkeypatch.setattr(kernel.torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(kernel, "SPLIT_DECODING_LENGTH", 2048)  # the sizes below are cut as a longer head would be
    generator = torch.Generator().manual_seed(n)
    query = torch.randn(3, 64, generator=generator).to(dtype)
    keys = (torch.randn(n, 64, generator=generator) * 2).to(dtype)
    values = torch.randn(n, 64, generator=generator).to(dtype)
    split = split_decoding_attention(query, keys, values, 0.125)
    if n < kernel.SPLIT_DECODING_LENGTH or threads < 2:
        assert split is None
        return
    assert split is not None and split.dtype == dtype and split.shape == (3, 64)

    def one_call(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None],
                                                                scale=0.125)[0, 0]

    exact = one_call(query.double(), keys.double(), values.double())
    if dtype == torch.float32:
        torch.testing.assert_close(split, one_call(query, keys, values), atol=1e-6, rtol=1e-5)
    else:
        assert (split.double() - exact).abs().max() <= 2 * (one_call(query, keys, values).double() - exact).abs().max()


@pytest.mark.parametrize(("strided", "lengths"), [(False, [5, 690, 701, 7]), (True, [5, 7, 690, 701])])
def test_long_heads_are_split_across_threads_in_the_grouped_step(monkeypatch, strided, lengths):
    """With the split lengths lowered, the two long heads of the ragged step are attended by the split kernel
    (only the short group calls SDPA) and the step's output is the padded view's: compact (each long head in place)
    or in strided runs (batch 2 × 2 KV heads: each batch row's long head a run of its own)."""
    monkeypatch.setattr(kernel.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(kernel, "SPLIT_DECODING_LENGTH", 600)
    monkeypatch.setattr(kernel, "SPLIT_PART_LENGTH", 300)
    monkeypatch.setattr(length_groups, "IN_PLACE_LENGTH", 600)
    monkeypatch.setattr(length_groups, "RUN_CALL_COST", 1)
    step = ragged_decoding_step(2, 2, 2, lengths, strided=strided)
    planned = step.store.length_groups()
    assert planned is not None and (step.store.runs is not None) == strided
    if strided:
        assert sorted(len(group.members) for group, _ in planned) == [1, 1, 2]
    padded = all_entries_output(step, step.module, None, None, step.view)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[int] = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    grouped = grouped_decode_output(step.store, step.query, step.scaling, planned)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    assert len(calls) == 1
    torch.testing.assert_close(grouped, padded, atol=1e-6, rtol=1e-5)


def test_the_split_declines_without_an_operator_returning_the_logsumexp(monkeypatch):
    """The private CPU operator is looked up at call time: absent, or with another signature, the split declines
    and the caller makes one call."""
    monkeypatch.setattr(kernel.torch, "get_num_threads", lambda: 2)
    query, keys = torch.randn(3, 64), torch.randn(4096, 64)
    monkeypatch.setattr(kernel, "_flash_with_logsumexp", lambda: None)
    assert split_decoding_attention(query, keys, keys, 0.125) is None

    def other_signature(*args, **kwargs):
        raise TypeError("unexpected keyword argument 'scale'")

    monkeypatch.setattr(kernel, "_flash_with_logsumexp", lambda: other_signature)
    assert split_decoding_attention(query, keys, keys, 0.125) is None
    monkeypatch.setattr(kernel, "_flash_with_logsumexp",
                        lambda: lambda q, k, v, **_: (torch.zeros(2, 1, 3, 64), torch.zeros(2, 3)))
    assert split_decoding_attention(query, keys, keys, 0.125) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adakv_decodes_the_same_padded_and_compact(monkeypatch, dtype):
    """AdaKV's ragged heads laid out padded (zero-copy view) or compact (gathered view each step): the same logits
    bit for bit at every decoding step, and the padded layout is what similar head lengths get."""
    from kvsieve.cache.store_compaction import StoreCompaction

    model = build_model("llama").to(dtype)
    ids = prompt(2, 64, seed=11)
    runs = []
    for forced in (None, False):
        if forced is not None:
            monkeypatch.setattr(StoreCompaction, "pads", lambda self, counts: False)
        cache = kvsieve.KVCache(model, "adakv", budget=24, window=4)
        logits = greedy_step_logits(model, cache, ids, 5)
        padded = sum(layer.store.is_padded for layer in cache.layers if layer.store is not None)
        runs.append((logits, padded))
    (padded_logits, padded_layers), (compact_logits, compact_layers) = runs
    assert padded_layers > 0 and compact_layers == 0
    assert torch.equal(padded_logits, compact_logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dbtrimkv_decodes_the_same_in_strided_runs_and_compact(monkeypatch, dtype):
    """DBTrimKV's global budget leaves heads of very different lengths, decoded by length group: laid out in
    strided runs (each group a zero-copy view) or compact (each group gathered at every step), the same logits at
    every decoding step (not bit for bit: the two layouts may cut the heads into different groups, so SDPA sums
    over different batches), with the budget's compactions in between (buffer 2)."""
    from helpers import random_gates

    from kvsieve.cache.store_compaction import StoreCompaction

    monkeypatch.setattr(length_groups, "CALL_COST", 1)  # the tiny model's short heads group as long ones would
    model = build_model("llama").to(dtype)
    gates = random_gates(model, seed=3)
    ids = prompt(2, 64, seed=12)
    runs = []
    for strided in (True, False):
        if not strided:
            monkeypatch.setattr(StoreCompaction, "plan_runs", lambda self, counts: None)
        cache = kvsieve.KVCache(model, "dbtrimkv", budget=12, buffer=2, window=2, gates=gates)
        logits = greedy_step_logits(model, cache, ids, 6)
        laid_out = sum(layer.store.runs is not None for layer in cache.layers if layer.store is not None)
        runs.append((logits, laid_out))
    (strided_logits, strided_layers), (compact_logits, compact_layers) = runs
    assert strided_layers > 0 and compact_layers == 0
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(strided_logits.float(), compact_logits.float(), atol=tolerance, rtol=tolerance)
