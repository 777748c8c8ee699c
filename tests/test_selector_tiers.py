"""Decoding-time selectors over a quantized cache (issue 21: "every attention path, selectors included, reads
quantized entries correctly").

A selector (Quest, SparQ, RocketKV's hybrid sparse attention, exact top-k) reads the combined view of a
store with tiers: every held entry in position order, quantized ones dequantized. So a selector over a mixed
cache must answer exactly as the same selector over a full-precision cache holding those dequantized entries;
its pages, value sums and member indices, kept up to date by appends and compactions, must be what a rebuild
from the combined view gives; and its measured traffic counts each entry as held.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_model
from helpers import prompt

import kvsieve
from kvsieve.cache.member_pages import MemberPages
from kvsieve.cache.pages import PageMinMax
from kvsieve.cache.selection_state import held_key_nbytes
from kvsieve.cache.store import LayerStore
from kvsieve.cache.value_mean import ValueSum
from kvsieve.parts.selectors.hsa import FilteredHybridSparse
from kvsieve.transformers_adapter import cache_kwargs

BUDGET, PROMPT, GROUP, VALUE_GROUP = 16, 96, 4, 8
SELECTORS = ["quest", "sparq", "hsa", "hsa_mt", "exact_topk"]


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def _mixed(model, selector: str, **params) -> kvsieve.KVCache:
    params = {"window": 4, **params} if "scorer" not in params else params
    return kvsieve.KVCache(model, "mixed", budget=BUDGET, selector=selector, group=GROUP, value_group=VALUE_GROUP,
                           **params)


def _plain(model, selector: str) -> kvsieve.KVCache:
    """The same selector over a full-precision cache that evicts nothing."""
    if selector == "hsa_mt":
        return kvsieve.KVCache(model, kvsieve.Policy(selector=FilteredHybridSparse(k=BUDGET), budget=BUDGET))
    return kvsieve.KVCache(model, selector, budget=BUDGET)


def _held_entries(store: LayerStore) -> dict[str, torch.Tensor]:
    """The store's combined view as the entries a full-precision store restores (quantized ones dequantized)."""
    view = store.dense()
    segments, length = store.segments, view.length
    valid = (view.valid if view.valid is not None else torch.ones(view.positions.shape, dtype=torch.bool))
    valid = valid.reshape(segments, length)
    out = {"lengths": valid.sum(dim=1), "keys": view.keys.reshape(segments, length, -1)[valid],
           "values": view.values.reshape(segments, length, -1)[valid],
           "positions": view.positions.reshape(segments, length)[valid]}
    for name, extra in view.extras.items():
        out[f"side.{name}"] = extra.reshape(segments, length, *extra.shape[3:])[valid]
    return out


@pytest.mark.parametrize("selector", SELECTORS)
def test_a_selector_reads_quantized_entries_as_the_same_entries_dequantized(model, selector):
    ids = prompt(length=PROMPT, seed=3)
    mixed = _mixed(model, selector)
    model(ids, **cache_kwargs(model, mixed))
    mixed.flush()
    plain = _plain(model, selector)
    model(ids, **cache_kwargs(model, plain))
    for ours, theirs in zip(mixed.layers, plain.layers, strict=True):
        assert ours.store.tiered and bool((ours.store.lengths() > BUDGET).all())  # more entries than the budget
        theirs.store.restore(_held_entries(ours.store))
    for step in range(4):  # teacher-forced: the same token to both caches
        token = prompt(length=1, seed=40 + step)
        got = model(token, **cache_kwargs(model, mixed)).logits
        expected = model(token, **cache_kwargs(model, plain)).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    read = mixed.traffic()
    assert read["steps"] == 4 * len(mixed.layers) and 0 < read["ratio"] < 1  # it selected at every step
    # the same entries, held quantized, are fewer bytes to read than in full precision
    assert read["read_bytes"] < plain.traffic()["read_bytes"]
    assert read["full_bytes"] < plain.traffic()["full_bytes"]


def _rebuilt(hook, store: LayerStore):
    fresh = copy.copy(hook)
    fresh.after_layout(store)  # from the combined view, as after a compaction
    return fresh


def _same_pages(kept: tuple[torch.Tensor, torch.Tensor], rebuilt: tuple[torch.Tensor, torch.Tensor]) -> None:
    slots = min(kept[0].shape[2], rebuilt[0].shape[2])
    for ours, theirs in zip(kept, rebuilt, strict=True):
        assert torch.equal(ours[:, :, :slots], theirs[:, :, :slots])  # min/max of stored keys: exact
        assert bool(torch.isinf(ours[:, :, slots:]).all()) and bool(torch.isinf(theirs[:, :, slots:]).all())


@pytest.mark.parametrize("selector", ["quest", "sparq", "hsa_mt"])
def test_selector_data_describe_the_combined_view_at_every_step(model, selector):
    """Under decoding-time compaction entries move into the tiers while decoding appends after them: the pages
    (Quest), value sums (SparQ) and member pages (HSA-MT) kept step by step equal a rebuild at every step."""
    cache = _mixed(model, selector, scorer="tova", schedule="decode", buffer=3)
    ids = prompt(length=PROMPT // 2, seed=5)
    model(ids, **cache_kwargs(model, cache))
    grew = False
    for step in range(12):
        model(prompt(length=1, seed=60 + step), **cache_kwargs(model, cache))
        for layer in cache.layers:
            store = layer.store
            grew |= store.tiered and int(store.tier_lengths().min()) > 0
            for hook in store.hooks:
                if isinstance(hook, PageMinMax):
                    _same_pages(hook.view(store), _rebuilt(hook, store).view(store))
                elif isinstance(hook, MemberPages):
                    fresh = _rebuilt(hook, store)
                    assert torch.equal(hook.count, fresh.count)
                    assert torch.equal(hook.members(store)[0], fresh.members(store)[0])
                    _same_pages(hook.view(store), fresh.view(store))
                elif isinstance(hook, ValueSum):
                    torch.testing.assert_close(hook.sums, _rebuilt(hook, store).sums, rtol=1e-5, atol=1e-5)
    assert grew  # entries were quantized while decoding


def test_traffic_counts_each_entry_as_held(model):
    """exact_topk reads every key and the values it selects: with tiers, a quantized key costs its codes and its
    group's share of steps and minimums, and full attention's reference is the bytes held."""
    cache = _mixed(model, "exact_topk")
    model(prompt(length=PROMPT, seed=7), **cache_kwargs(model, cache))
    cache.flush()
    model(prompt(length=1, seed=8), **cache_kwargs(model, cache))
    traffic = cache.traffic()
    assert traffic["full_bytes"] == cache.kv_nbytes()  # no compaction at this step: what it held then
    keys = sum(held_key_nbytes(layer.store) for layer in cache.layers)
    assert keys < traffic["read_bytes"] < traffic["full_bytes"]
    full_keys = sum(layer.store.total_entries() for layer in cache.layers)  # full-precision keys alone
    assert keys > full_keys * layer_key_bytes(cache)


def layer_key_bytes(cache: kvsieve.KVCache) -> int:
    store = cache.layers[0].store
    return store.keys.element_size() * store.head_dim


def test_rows_selected_apart_leave_the_tiers_whole(model):
    """A batch whose rows get different selector configurations is selected row group by row group on a copy of
    the store restricted to the group's rows; the copy must not touch the tiers of the store it copies."""
    cache = _mixed(model, "quest")
    ids = torch.cat([prompt(length=PROMPT, seed=9), prompt(length=PROMPT, seed=10)])
    mask = torch.ones_like(ids)
    mask[1, : PROMPT - 24] = 0  # the second row is 24 tokens long: its own page size (2 entries, not 3)
    model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    cache.flush()
    configs = cache.policy.selector.row_config(cache.layers[0].store)
    assert configs is not None and len({c["page_size"] for c in configs}) == 2
    groups = {tuple(layer.store.tiers[0].groups_per_segment.tolist()) for layer in cache.layers}
    for step in range(3):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        out = model(prompt(batch=2, length=1, seed=20 + step), attention_mask=mask, **cache_kwargs(model, cache))
        assert torch.isfinite(out.logits).all()
        for layer in cache.layers:
            assert all(tier.batch == 2 for tier in layer.store.tiers)
    assert {tuple(layer.store.tiers[0].groups_per_segment.tolist()) for layer in cache.layers} == groups


def test_batch_selection_and_restore_tell_hooks_once_the_tiers_moved():
    """``select_batch`` and ``restore`` change the full-precision store and then the tiers; a hook rebuilding from
    the combined view must be told after both (told in between, it read tiers of the old batch)."""
    gen = torch.Generator().manual_seed(0)
    store = LayerStore(2, 2, 16, torch.float32, torch.device("cpu"))
    store.append(torch.randn(2, 2, 12, 16, generator=gen), torch.randn(2, 2, 12, 16, generator=gen), 0, None)
    store.add_tier(bits=4, group=4, value_group=8)
    low = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]]).expand(4, -1)
    store.keep(torch.arange(12).expand(4, -1), torch.full((4,), 12),
               torch.tensor([1] * 8 + [0] * 4).expand(4, -1))
    assert store.tiered and low.shape[1] == int(store.tier_lengths().max())
    pages = PageMinMax(4)
    store.add_hook(pages)
    saved = store.entries()
    store.select_batch(torch.tensor([1]))
    _same_pages(pages.view(store), _rebuilt(pages, store).view(store))
    assert pages.view(store)[0].shape[:2] == (1, 2)
    other = LayerStore(2, 2, 16, torch.float32, torch.device("cpu"))
    other.add_hook(PageMinMax(4))
    other.restore(saved)
    _same_pages(other.hooks[0].view(other), _rebuilt(other.hooks[0], other).view(other))
    assert bool(torch.isfinite(other.hooks[0].view(other)[0][:, :, :3]).all())  # 3 pages of 12 entries
