"""Decoding-time sparse attention (issue 11): Quest, SparQ, HSA, RocketKV and RocketKV-MT.

Exactness where nothing is approximated (budget ≥ held, SparQ with every dimension and token, HSA with
every dimension and one-entry pages), the page bound property, page statistics against brute force
after appends, stage-1 eviction and re-filtering, the paper's stage counts, and measured traffic
within the token budget.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import generate, prompt

import kvsieve
from kvsieve.attention.kernel import attend
from kvsieve.cache.member_pages import STAGE1_KEEP, MemberPages
from kvsieve.cache.pages import PageMinMax
from kvsieve.cache.selection_state import SelectionState
from kvsieve.cache.store import LayerStore
from kvsieve.core.part import PolicyConfigError
from kvsieve.core.selection import Selection
from kvsieve.core.step import LayerStep
from kvsieve.models.architectures import ArchitectureSpec, ModelInfo
from kvsieve.parts.allocators.two_stage import stage1_keep
from kvsieve.parts.selectors.exact_topk import ExactTopK
from kvsieve.parts.selectors.hsa import HybridSparse, hsa_shape
from kvsieve.parts.selectors.quest import Quest, page_upper_bounds
from kvsieve.parts.selectors.sparq import SparQ
from kvsieve.parts.selectors.sparse import page_valid, rocket_split
from kvsieve.transformers_adapter import cache_kwargs

SELECTION_PRESETS = ("quest", "sparq", "hsa", "rocketkv", "rocketkv_mt")
STEPS = 6


def _quiet_cache(model, name, **params):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kvsieve.KVCache(model, name, **params)


def _generate(model, ids, cache, steps=STEPS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing was compressed" when the budget covers the prompt
        return generate(model, ids, cache, steps)


# ------------------------------------------------------------------------------------ exact when t ≥ held
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("name", SELECTION_PRESETS)
def test_budget_covering_everything_equals_full_attention(arch, name):
    from conftest import get_model

    model = get_model(arch, "kv")
    ids = prompt(batch=2, length=24, seed=5)
    _, full_logits = _generate(model, ids, kvsieve.KVCache(model, "full"))
    cache = _quiet_cache(model, name, budget=64)
    _, logits = _generate(model, ids, cache)
    for a, b in zip(logits, full_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert cache.traffic()["ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", (*SELECTION_PRESETS[:3], "rocketkv_mt"))
def test_selection_methods_delete_nothing(name):
    from conftest import get_model

    model = get_model("llama", "kv")
    ids = prompt(batch=2, length=90, seed=2)
    full = kvsieve.KVCache(model, "full")
    _, full_logits = _generate(model, ids, full)
    cache = _quiet_cache(model, name, budget=40)
    _, logits = _generate(model, ids, cache)
    assert torch.equal(cache.head_lengths(), full.head_lengths())
    assert max((a - b).abs().max().item() for a, b in zip(logits[1:], full_logits[1:], strict=True)) > 1e-4
    assert "selection" in kvsieve.list_policies()[name].summary


# ------------------------------------------------------------------------------------ unit fixtures
def _store_step(batch=2, kv_heads=2, groups=3, length=37, dim=8, seed=0, padded=False, hooks=()):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=generator)
    keys = torch.randn(batch, kv_heads, length, dim, generator=generator)
    values = torch.randn(batch, kv_heads, length, dim, generator=generator)
    token_valid = None
    if padded:
        token_valid = torch.ones(batch, length, dtype=torch.bool)
        token_valid[1, :5] = False
    store = LayerStore(batch, kv_heads, dim, torch.float32, torch.device("cpu"))
    for hook in hooks:
        store.add_hook(hook)
    store.append(keys, values, 0, token_valid)
    info = ModelInfo(ArchitectureSpec(), 1, kv_heads * groups, kv_heads, dim, (None,))
    step = LayerStep(module=None, layer_idx=0, info=info, query=query, first_position=length - 1,
                     query_valid=None, store=store, scaling=dim**-0.5)
    return store, step


def _full_attention(step: LayerStep) -> torch.Tensor:
    """Softmax over every held entry, written out: ``(batch, 1, q_heads, d)``."""
    view = step.view
    keys = view.keys.repeat_interleave(step.groups, dim=1)
    values = view.values.repeat_interleave(step.groups, dim=1)
    logits = torch.matmul(step.query, keys.transpose(-1, -2)) * step.scaling
    if view.valid is not None:
        logits = logits.masked_fill(~view.valid.repeat_interleave(step.groups, dim=1)[:, :, None, :], -math.inf)
    return torch.matmul(torch.softmax(logits, dim=-1), values).transpose(1, 2)


# ------------------------------------------------------------------------------------ Quest
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 3, 8])
def test_quest_page_bound_is_at_least_every_score_of_its_page(seed, page_size):
    hook = PageMinMax(page_size)
    store, step = _store_step(seed=seed, length=29 + seed, padded=seed % 2 == 1, hooks=(hook,))
    kmax, kmin = hook.view(store)
    held = page_valid(kmax)
    query = step.query.reshape(2, 2, 3, 8)
    bound = page_upper_bounds(query, kmax, kmin, held)  # (b, kv, g, slots)
    view = step.view
    logits = torch.matmul(query, view.keys.transpose(-1, -2))  # (b, kv, g, L)
    lengths = store.lengths()
    for b in range(2):
        for h in range(2):
            n = int(lengths[b, h])
            for p in range(math.ceil(n / page_size)):
                true_max = logits[b, h, :, p * page_size : min((p + 1) * page_size, n)].amax(dim=-1)
                assert (bound[b, h, :, p] >= true_max - 1e-5).all()
            # brute force: the bound is also reached by the element-wise max/min formula
            q = query[b, h, :, None, :]
            brute = torch.maximum(q * kmax[b, h, None], q * kmin[b, h, None])
            pages = math.ceil(n / page_size)
            torch.testing.assert_close(bound[b, h, :, :pages], brute.sum(-1)[:, :pages], atol=1e-5, rtol=1e-5)


def test_quest_always_attends_the_last_page_and_whole_pages():
    _store, step = _store_step(length=40, hooks=Quest(k=8, page_size=4).hooks())
    chosen = Quest(k=8, page_size=4).select(step)
    assert chosen is not None and chosen.shape == (2, 6, 4)
    for b in range(2):
        for qh in range(6):
            picked = set(chosen[b, qh].tolist())
            assert {36, 37, 38, 39} <= picked  # the last page (the newest entries)
            assert len(picked) == 4


# ------------------------------------------------------------------------------------ SparQ
@pytest.mark.parametrize("padded", [False, True])
def test_sparq_with_every_dimension_and_token_equals_full_attention(padded):
    selector = SparQ(k=4, r=8, top=64)
    _store, step = _store_step(padded=padded, hooks=selector.hooks())
    selection = selector.select(step)
    assert isinstance(selection, Selection)
    torch.testing.assert_close(selection.weight, torch.ones_like(selection.weight), atol=1e-6, rtol=0)
    view = step.view
    out = attend(None, step.query, view.keys, view.values, None, step.scaling, subset=selection.indices,
                 key_valid=view.valid, blend=(selection.weight, selection.fallback))
    torch.testing.assert_close(out, _full_attention(step), atol=1e-5, rtol=0)


def test_sparq_mixes_the_mean_value_by_the_approximate_mass():
    selector = SparQ(k=8, r=3, top=4)
    _store, step = _store_step(hooks=selector.hooks())
    selection = selector.select(step)
    assert isinstance(selection, Selection)
    view = step.view
    # the mean value is the mean of every held value (running sum kept exact)
    torch.testing.assert_close(selection.fallback[:, ::3], view.values.mean(dim=2), atol=1e-6, rtol=0)
    assert ((selection.weight > 0) & (selection.weight < 1)).all()
    out = attend(None, step.query, view.keys, view.values, None, step.scaling, subset=selection.indices,
                 blend=(selection.weight, selection.fallback))
    plain = attend(None, step.query, view.keys, view.values, None, step.scaling, subset=selection.indices)
    w = selection.weight[:, None, :, None]
    torch.testing.assert_close(out, w * plain + (1 - w) * selection.fallback[:, None], atol=1e-6, rtol=0)


def test_value_sum_stays_exact_after_appends_and_compaction():
    selector = SparQ(k=8)
    store, _ = _store_step(padded=True, hooks=selector.hooks())
    values_hook = store.hooks[1]
    for i in range(3):
        store.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), 37 + i, None)
    local = torch.arange(10).repeat(4, 1)
    store.keep(local, torch.tensor([10, 7, 10, 9]))
    store.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), 50, None)
    view = store.dense()
    expected = view.values.masked_fill(~view.valid[..., None], 0).sum(dim=2)
    torch.testing.assert_close(values_hook.sums.view(2, 2, 8), expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ HSA
@pytest.mark.parametrize("padded", [False, True])
def test_hsa_with_every_dimension_and_one_entry_pages_is_exact_group_topk(padded):
    selector = HybridSparse(k=12, page_size=1, k1=8)
    _store, step = _store_step(padded=padded, hooks=selector.hooks())
    chosen = selector.select(step)
    assert chosen is not None
    view = step.view
    query = step.query.reshape(2, 2, 3, 8)
    logits = torch.matmul(query.sum(dim=2, keepdim=True), view.keys.transpose(-1, -2))[:, :, 0]  # group sum
    if view.valid is not None:
        logits = logits.masked_fill(~view.valid, -math.inf)
    expected = torch.topk(logits, 6, dim=-1).indices
    for b in range(2):
        for qh in range(6):
            assert set(chosen[b, qh].tolist()) == set(expected[b, qh // 3].tolist())


def test_hsa_with_one_head_per_group_equals_exact_topk():
    selector = HybridSparse(k=20, page_size=1, k1=8)
    _store, step = _store_step(groups=1, hooks=selector.hooks())
    chosen = selector.select(step)
    oracle = ExactTopK(10).select(step)
    assert chosen is not None and oracle is not None
    assert torch.equal(chosen.sort(dim=-1).values, oracle.sort(dim=-1).values)


def test_hsa_shape_follows_the_paper():
    # Sec. 3.6 example: c = 64 → r = 0.56, c^{1-r} = 6.2, page 3 and ~2.1× on the head dimension
    assert rocket_split(64) == pytest.approx(0.56)
    n2 = 64**0.44 * 256  # what stage 1 leaves for t = 256
    page, k1 = hsa_shape(round(n2), 256, 128)
    assert page == 3 and k1 == int(128 * 3 / (round(n2) / 256))
    assert hsa_shape(100, 256, 64) == (1, 64)  # nothing to compress


def _brute_member_pages(store: LayerStore, size: int):
    view = store.dense()
    member = view.extras[STAGE1_KEEP.name] & (view.valid if view.valid is not None else True)
    out = {}
    for b in range(store.batch):
        for h in range(store.heads):
            keys = view.keys[b, h][member[b, h]]
            out[b, h] = [(keys[p : p + size].amax(0), keys[p : p + size].amin(0)) for p in range(0, len(keys), size)]
    return out


@pytest.mark.parametrize("padded", [False, True])
def test_member_pages_stay_exact_after_marks_and_appends(padded):
    hook = MemberPages(3, STAGE1_KEEP.name)
    store, _ = _store_step(length=20, padded=padded)
    store.ensure_side(STAGE1_KEEP)
    store.add_hook(hook)
    from kvsieve.core.plan import Plan
    from kvsieve.parts.actions.mark import Mark

    keep = torch.tensor(
        [[0, 2, 3, 7, 9, 11, 12], [5, 6, 8, 10, 13, 14, 0], [1, 2, 3, 4, 5, 6, 7], [6, 7, 9, 10, 0, 0, 0]]
    )
    Mark().apply(store, Plan(keep, torch.tensor([7, 6, 7, 4])))

    def check() -> None:
        brute = _brute_member_pages(store, 3)
        kmax, kmin = hook.view(store)
        index, valid = hook.members(store)
        view = store.dense()
        for (b, h), pages in brute.items():
            member = view.extras[STAGE1_KEEP.name][b, h] & (view.valid[b, h] if view.valid is not None else True)
            assert index[b, h][valid[b, h]].tolist() == member.nonzero()[:, 0].tolist()
            for p, (mx, mn) in enumerate(pages):
                assert torch.equal(kmax[b, h, p], mx) and torch.equal(kmin[b, h, p], mn)
            assert (kmax[b, h, len(pages):] == -math.inf).all()

    check()
    for i in range(70):  # past the growth slack
        store.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), 20 + i, None)
        if i in (0, 1, 2, 69):
            check()


# ------------------------------------------------------------------------------------ RocketKV
def test_rocketkv_stage_counts_follow_the_formulas():
    from conftest import get_model

    model = get_model("llama", "kv")
    n, t = 200, 40
    ids = prompt(batch=1, length=n, seed=1)
    cache = _quiet_cache(model, "rocketkv", budget=t)
    _generate(model, ids, cache, steps=2)
    c = n / t
    r = min(0.2 + 0.06 * math.log2(c), 0.8)
    kept = math.ceil(n / c**r)
    assert kept == 116 and int(stage1_keep(torch.tensor([n]), t)[0]) == kept
    # stage 1 kept N / c^r per group, then two decoded tokens were appended (nothing evicted at decoding)
    assert (cache.head_lengths() == kept + 1).all()  # generate(steps=2): one decoding forward after the prompt
    store = cache.layers[0].store
    state = next(h for h in store.hooks if isinstance(h, SelectionState))
    page, k1 = hsa_shape(kept + 1, t, store.head_dim)  # configured at the first decoding step (new token held)
    assert state.config == {"page_size": page, "k1": k1}
    assert page == math.ceil(math.sqrt((kept + 1) / t)) and k1 == int(store.head_dim * page / ((kept + 1) / t))
    pages = next(h for h in store.hooks if isinstance(h, PageMinMax))
    assert pages.page_size == page


def test_rocketkv_pages_stay_exact_after_stage1_eviction_and_appends():
    from conftest import get_model

    model = get_model("qwen3", "kv")
    ids = prompt(batch=2, length=120, seed=4)
    cache = _quiet_cache(model, "rocketkv", budget=36)
    _generate(model, ids, cache, steps=5)
    for layer in cache.layers:
        store = layer.store
        hook = next(h for h in store.hooks if isinstance(h, PageMinMax))
        size = hook.page_size
        view = store.dense()
        kmax, kmin = hook.view(store)
        n = view.length
        for p in range(math.ceil(n / size)):
            chunk = view.keys[:, :, p * size : min((p + 1) * size, n)].float()
            assert torch.equal(kmax[:, :, p], chunk.amax(2)) and torch.equal(kmin[:, :, p], chunk.amin(2))


def test_rocketkv_mt_holds_everything_and_refilters_each_turn():
    from conftest import get_model

    model = get_model("llama", "kv")
    t = 40
    ids = prompt(batch=1, length=150, seed=6)
    full = kvsieve.KVCache(model, "full")
    cache = _quiet_cache(model, "rocketkv_mt", budget=t)
    seq, _ = _generate(model, ids, cache, steps=4)
    _full_seq, _ = _generate(model, ids, full, steps=4)
    assert torch.equal(cache.head_lengths(), full.head_lengths())  # every entry held
    assert not cache.policy.evicts and kvsieve.make_policy("rocketkv", budget=t).evicts
    store = cache.layers[0].store
    marks = store.dense().extras[STAGE1_KEEP.name]
    # turn 1: stage 1 marked N / c^r of the 150 prompt entries; the 3 decoded since are members too
    assert (marks.sum(dim=-1) == int(stage1_keep(torch.tensor([150]), t)[0]) + 3).all()
    # turn 2: the whole history (153 held + the last generated token + 30 new) is re-filtered
    turn2 = torch.cat([seq, prompt(batch=1, length=30, seed=7)], dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(turn2, max_new_tokens=3, do_sample=False, **cache_kwargs(model, cache))
    held = int(cache.head_lengths()[0, 0, 0])
    assert held == 184 + 2
    marks = cache.layers[0].store.dense().extras[STAGE1_KEEP.name]
    assert (marks.sum(dim=-1) == int(stage1_keep(torch.tensor([184]), t)[0]) + 2).all()
    assert cache.storage()["kv"] == cache.kv_nbytes()


# ------------------------------------------------------------------------------------ traffic and storage
@pytest.mark.parametrize("name", ["sparq", "hsa", "rocketkv", "rocketkv_mt", "quest", "exact_topk"])
def test_measured_traffic_is_within_the_token_budget(name):
    from conftest import get_model

    model = get_model("llama", "kv")
    t = 40
    ids = prompt(batch=2, length=200, seed=3)
    cache = _quiet_cache(model, name, budget=t)
    _generate(model, ids, cache, steps=4)
    traffic = cache.traffic()
    store = cache.layers[0].store
    token = 2 * store.head_dim * store.keys.element_size()
    groups_steps = traffic["steps"] * store.batch * store.heads
    per_group_step = traffic["read_bytes"] / groups_steps / token  # in key+value pairs
    assert traffic["steps"] == 3 * len(cache.layers)  # decoding forwards × layers
    if name in ("sparq", "hsa", "rocketkv", "rocketkv_mt"):
        assert per_group_step <= t + 1  # + SparQ's mean value (a d-vector)
        assert per_group_step >= t / 2
    elif name == "quest":  # the group's heads may need both Kmax and Kmin of a dimension: up to 1.5 t
        assert t / 2 <= per_group_step <= 1.5 * t + 1
    else:  # exact top-k reads every key
        assert per_group_step > 200 / 2
    assert traffic["ratio"] < 1.0
    storage = cache.storage()
    assert storage["allocated"] >= storage["kv"] + storage["aux"]
    if name != "exact_topk":
        assert storage["aux"] > 0


def test_rocketkv_storage_matches_table1():
    """Storage: stage 1 keeps N/c^r; page min/max add 2·(N/c^r)/s key-sized rows (fp32 here)."""
    from conftest import get_model

    model = get_model("llama", "kv")
    n, t = 240, 40
    ids = prompt(batch=1, length=n, seed=3)
    cache = _quiet_cache(model, "rocketkv", budget=t)
    full = kvsieve.KVCache(model, "full")
    _generate(model, ids, cache, steps=2)
    _generate(model, ids, full, steps=2)
    kept = int(stage1_keep(torch.tensor([n]), t)[0])
    assert cache.kv_nbytes() == full.kv_nbytes() * (kept + 1) // (n + 1)


# ------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(("name", "params", "needle"), [
    ("quest", {"budget": 1}, "k must be an int ≥ 2"),
    ("quest", {"budget": 16, "page_size": -1}, "page_size"),
    ("sparq", {"budget": 16, "r": -2}, "r must be"),
    ("hsa", {"budget": 16, "k1": 1.5}, "k1"),
    ("rocketkv", {"ratio": 0.5}, "budget"),
    ("rocketkv", {"budget": 64, "schedule": "decode"}, "schedule"),
])
def test_bad_parameters_raise_before_any_work(name, params, needle):
    with pytest.raises(PolicyConfigError, match=needle):
        kvsieve.make_policy(name, **params)


def test_page_statistics_keep_the_key_dtype_exactly():
    store = LayerStore(1, 2, 8, torch.bfloat16, torch.device("cpu"))
    hook = PageMinMax(4)
    store.add_hook(hook)
    store.append(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), 0, None)
    store.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 10, None)
    kmax, kmin = hook.view(store)
    assert kmax.dtype == torch.bfloat16
    keys = store.dense().keys
    for p in range(3):
        chunk = keys[:, :, p * 4 : (p + 1) * 4]
        assert torch.equal(kmax[:, :, p], chunk.amax(2)) and torch.equal(kmin[:, :, p], chunk.amin(2))


def test_uniform_decoding_appends_update_pages_in_place_without_host_reads():
    """A decoding step on a uniform store (one key per segment, the same slot in each) updates its page's max/min in
    place: the pages equal the held keys' after every step, across page boundaries and page growth, with no device
    read (``item``/``bool``: a host round trip per layer and step on a GPU) and no scatter index built."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    store = LayerStore(2, 2, 8, torch.float32, torch.device("cpu"))
    hook = PageMinMax(3)
    store.add_hook(hook)
    gen = torch.Generator().manual_seed(3)
    store.append(torch.randn(2, 2, 7, 8, generator=gen), torch.randn(2, 2, 7, 8, generator=gen), 0, None)
    for step in range(40):  # 47 entries: 16 pages, past PAGE_GROWTH's slots
        keys = torch.randn(2, 2, 1, 8, generator=gen)
        recorder = Recorder()
        with recorder:
            store.append(keys, torch.randn(2, 2, 1, 8, generator=gen), 7 + step, None)
        assert not [op for op in recorder.ops if "_local_scalar_dense" in op or "scatter" in op], recorder.ops
        kmax, kmin = hook.view(store)
        held = store.dense().keys
        n = held.shape[2]
        for p in range(math.ceil(n / 3)):
            chunk = held[:, :, 3 * p : min(3 * p + 3, n)]
            assert torch.equal(kmax[:, :, p], chunk.amax(2)) and torch.equal(kmin[:, :, p], chunk.amin(2))
        assert (kmax[:, :, math.ceil(n / 3):] == -math.inf).all() and (kmin[:, :, math.ceil(n / 3):] == math.inf).all()
