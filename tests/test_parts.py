"""The rebuilt engine's parts: composition without new code, merge with the log-count bias, global budgets,
per-page key statistics, layer inputs for learned scorers, and plans as data."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import build_model
from helpers import decode_loop, left_pad, prompt

import kvsieve
from kvsieve.attention.kernel import attend, output_mask
from kvsieve.cache.pages import PageMinMax
from kvsieve.cache.store import LayerStore
from kvsieve.core.plan import Plan
from kvsieve.core.step import LAYER_INPUTS, MERGE_COUNT, LayerStep
from kvsieve.models.architectures import architecture_of, decoder_layers
from kvsieve.parts.actions.merge import Merge
from kvsieve.parts.allocators.adaptive import Adaptive
from kvsieve.parts.allocators.global_budget import GlobalBudget
from kvsieve.parts.allocators.pyramid import Pyramid
from kvsieve.parts.scorers.base import Scorer
from kvsieve.parts.scorers.restkv import OutputReconstruction
from kvsieve.parts.scorers.snapkv import WindowAttention
from kvsieve.parts.scorers.tova import LastQueryAttention
from kvsieve.policies import Policy, make_policy
from kvsieve.transformers_adapter import cache_kwargs


# ---------------------------------------------------------------------------------------------- composition
def test_any_scorer_with_any_allocator_by_name(model):
    ids = prompt(length=40)
    ada = kvsieve.KVCache(model, "restkv", budget=12, window=4, allocator="adaptive")
    assert isinstance(ada.policy.allocator, Adaptive) and isinstance(ada.policy.scorer, OutputReconstruction)
    model(ids, **cache_kwargs(model, ada))
    lengths = ada.head_lengths()
    managed = list(ada.info.managed_layers)
    # head-wise allocation: the layer total is H·B, heads may differ
    assert (lengths[managed].sum(-1) == 12 * ada.info.num_kv_heads).all()
    pyramid = kvsieve.KVCache(model, "tova", budget=12, allocator="pyramid")
    assert isinstance(pyramid.policy.allocator, Pyramid)
    model(ids, **cache_kwargs(model, pyramid))
    budgets = [pyramid.policy.allocator.layer_budget(12, i, model.config.num_hidden_layers, 0) for i in managed]
    for layer, budget in zip(managed, budgets, strict=True):
        assert (pyramid.head_lengths()[layer] == budget).all()


def test_ada_restkv_preset_equals_restkv_with_adaptive_allocator(model):
    ids = prompt(length=40, seed=3)
    preset = kvsieve.KVCache(model, "ada_restkv", budget=12, window=4)
    composed = kvsieve.KVCache(model, "restkv", budget=12, window=4, allocator="adaptive")
    model(ids, **cache_kwargs(model, preset))
    model(ids, **cache_kwargs(model, composed))
    assert torch.equal(preset.head_lengths(), composed.head_lengths())
    for layer in preset.info.managed_layers:
        for head in range(preset.info.num_kv_heads):
            assert torch.equal(preset.kept_positions(layer, 0, head), composed.kept_positions(layer, 0, head))


def test_parts_passed_as_objects(model):
    policy = Policy(scorer=WindowAttention(window=4, kernel_size=3), allocator=Adaptive(alpha=0.5), budget=10,
                    name="mine")
    cache = kvsieve.KVCache(model, policy)
    model(prompt(length=30), **cache_kwargs(model, cache))
    assert str(policy).startswith("mine(budget=10")
    assert int(cache.head_lengths()[list(cache.info.managed_layers)].sum(-1).max()) <= 10 * cache.info.num_kv_heads


def test_adakv_routes_its_parameters_to_the_base_scorer():
    policy = make_policy("adakv", budget=16, window=4, base="restkv", kernel_size=7, alpha=0.5)
    assert isinstance(policy.scorer, OutputReconstruction)
    assert policy.scorer.kernel_size == 7 and policy.scorer.window == 4
    assert policy.allocator.alpha == 0.5 and policy.scorer.alpha == 0.3  # adakv's alpha is the floor's


def test_adaptive_floor_counts_outside_the_window():
    """Official AdaKV: each head keeps its window plus ⌊α·(B - w)⌋ entries outside it."""
    strong = torch.cat([torch.arange(14, 0, -1).float(), torch.full((2,), math.inf)])
    weak = torch.cat([torch.full((14,), 0.1), torch.full((2,), math.inf)])
    scores = torch.stack([strong, weak])[None]
    lengths, nominal = torch.tensor([[16, 16]]), torch.tensor([[10, 10]])
    new = Adaptive(alpha=0.5).allocate(scores, nominal, lengths)
    old = Adaptive(alpha=0.5, floor="budget").allocate(scores, nominal, lengths)
    assert new.tolist() == [[14, 6]]  # weak head: window 2 + ⌊0.5·(10 - 2)⌋ = 4 outside it
    assert old.tolist() == [[15, 5]]  # ⌊0.5·10⌋ counting the window: only 3 outside it
    assert int(new.sum()) == int(old.sum()) == 20


def test_tova_official_reading_shares_one_set_per_layer(model):
    cache = kvsieve.KVCache(model, "tova", budget=10)
    model(prompt(length=30), **cache_kwargs(model, cache))
    for layer in cache.info.managed_layers:
        first = cache.kept_positions(layer, 0, 0)
        for head in range(1, cache.info.num_kv_heads):
            assert torch.equal(cache.kept_positions(layer, 0, head), first)
    assert make_policy("tova", budget=4, heads="group").scorer == LastQueryAttention(heads="group")


def test_expand_gqa_stores_one_segment_per_query_head(model):
    cache = kvsieve.KVCache(model, "snapkv", budget=10, window=4, expand_gqa=True)
    ids = prompt(length=30)
    tokens, _ = decode_loop(model, cache, ids, 2)
    assert cache.head_lengths().shape[-1] == model.config.num_attention_heads
    ref = kvsieve.KVCache(model, "full")
    ref_tokens, _ = decode_loop(model, ref, ids, 2)
    assert tokens.shape == ref_tokens.shape


# ---------------------------------------------------------------------------------------------- global budget
def test_global_allocator_holds_exactly_the_total_budget_ragged(model):
    ids, mask, _ = left_pad([prompt(length=40)[0], prompt(length=29, seed=5)[0]])
    policy = Policy(scorer=WindowAttention(window=2), allocator=GlobalBudget(), budget=9, name="global_snapkv")
    cache = kvsieve.KVCache(model, policy)
    model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    managed = list(cache.info.managed_layers)
    lengths = cache.head_lengths()[managed]  # (layers, batch, heads)
    total = 9 * len(managed) * cache.info.num_kv_heads
    assert (lengths.sum(dim=(0, 2)) == total).all()
    assert (lengths >= 2).all()  # every head keeps its protected window
    for layer in managed:
        for b in range(2):
            for h in range(cache.info.num_kv_heads):
                pos = cache.kept_positions(layer, b, h)
                assert (pos[1:] > pos[:-1]).all()


def test_global_allocator_equals_brute_force_top_k():
    scores = [torch.rand(2, 3, 7, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    lengths = [torch.full((2, 3), 7) for _ in scores]
    nominal = [torch.full((2, 3), 2) for _ in scores]
    counts = GlobalBudget().allocate_global(scores, nominal, lengths)
    for b in range(2):
        flat = torch.cat([s[b].reshape(-1) for s in scores])
        threshold = torch.topk(flat, 18).values[-1]
        expected = [(s[b] >= threshold).sum(-1) for s in scores]
        for got, want in zip(counts, expected, strict=True):
            assert torch.equal(got[b], want)


def test_global_allocator_refuses_blockwise():
    with pytest.raises(kvsieve.PolicyConfigError, match="schedule"):
        Policy(scorer=WindowAttention(window=2), allocator=GlobalBudget(), budget=8, schedule="blockwise")


# ---------------------------------------------------------------------------------------------- merge + bias
def _segment_store(keys: torch.Tensor, values: torch.Tensor) -> LayerStore:
    store = LayerStore(1, 1, keys.shape[-1], torch.float32, torch.device("cpu"))
    store.ensure_side(Merge.SIDE[0])
    store.append(keys[None, None], values[None, None], 0, None)
    return store


def test_merging_identical_copies_equals_attending_to_every_copy():
    """A centre that absorbed n bit-identical copies of itself + the log n bias = the n copies."""
    torch.manual_seed(0)
    d, n = 8, 5
    other_k, other_v = torch.randn(3, d), torch.randn(3, d)
    centre_k, centre_v = torch.randn(d), torch.randn(d)
    keys = torch.cat([other_k, centre_k.expand(n, d)])
    values = torch.cat([other_v, centre_v.expand(n, d)])
    query = torch.randn(1, 1, 1, d)
    module = torch.nn.Module()
    dense = attend(module, query, keys[None, None], values[None, None], None, d**-0.5)
    store = _segment_store(keys, values)
    keep = torch.tensor([[0, 1, 2, 3]])
    plan = Plan(keep, torch.tensor([4]), merge_source=torch.tensor([[4, 5, 6, 7]]),
                merge_target=torch.tensor([[3, 3, 3, 3]]), merge_weight=torch.tensor([[0.3, 1.0, 2.0, 0.1]]))
    Merge().apply(store, plan)
    view = store.dense()
    assert view.keys.shape[2] == 4
    assert torch.equal(view.extras[MERGE_COUNT][0, 0], torch.tensor([1.0, 1, 1, n]))
    torch.testing.assert_close(view.keys[0, 0, 3], centre_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(view.values[0, 0, 3], centre_v, atol=1e-6, rtol=1e-6)
    bias = view.extras[MERGE_COUNT].log()
    mask = output_mask(lambda: torch.tensor([8]), lambda: view.positions, None, None, 1, bias, newest_query=True)
    merged = attend(module, query, view.keys, view.values, mask, d**-0.5)
    torch.testing.assert_close(merged, dense, atol=1e-6, rtol=1e-6)


def test_merge_without_assignments_is_eviction():
    keys, values = torch.randn(6, 4), torch.randn(6, 4)
    a, b = _segment_store(keys, values), _segment_store(keys, values)
    plan = Plan(torch.tensor([[0, 2, 5]]), torch.tensor([3]))
    Merge().apply(a, plan)
    a_keys = a.dense().keys
    b.keep(plan.keep, plan.counts)
    assert torch.equal(a_keys, b.dense().keys)


def test_merge_action_in_a_model_keeps_counts_and_budgets(model):
    policy = Policy(scorer=WindowAttention(window=4), action=Merge(), budget=10, name="merge_evict")
    cache = kvsieve.KVCache(model, policy)
    decode_loop(model, cache, prompt(length=30), 3)
    store = cache.layers[cache.info.managed_layers[0]].store
    assert MERGE_COUNT in store.extras and (store.dense().extras[MERGE_COUNT] == 1).all()


# ---------------------------------------------------------------------------------------------- pages
def _brute_pages(store: LayerStore, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    view = store.dense()
    pages = math.ceil(view.length / size)
    kmax = torch.full((store.batch, store.heads, pages, store.head_dim), -math.inf)
    kmin = torch.full_like(kmax, math.inf)
    lengths = store.lengths()
    for b in range(store.batch):
        for h in range(store.heads):
            n = int(lengths[b, h])
            for p in range(math.ceil(n / size)):
                chunk = view.keys[b, h, p * size : min((p + 1) * size, n)]
                kmax[b, h, p], kmin[b, h, p] = chunk.amax(0), chunk.amin(0)
    return kmax, kmin


@pytest.mark.parametrize("ragged", [False, True])
def test_page_min_max_stay_exact_after_appends_and_compaction(ragged):
    torch.manual_seed(1)
    store = LayerStore(2, 2, 4, torch.float32, torch.device("cpu"))
    hook = PageMinMax(3)
    store.add_hook(hook)
    valid = torch.tensor([[True] * 7, [False, False] + [True] * 5]) if ragged else None
    store.append(torch.randn(2, 2, 7, 4), torch.randn(2, 2, 7, 4), 0, valid)

    def check() -> None:
        kmax, kmin = _brute_pages(store, 3)
        got_max, got_min = hook.view(store)
        pages = kmax.shape[2]
        assert torch.equal(got_max[:, :, :pages], kmax) and torch.equal(got_min[:, :, :pages], kmin)
        assert (got_max[:, :, pages:] == -math.inf).all()

    check()
    for step in range(5):
        store.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4), 7 + step, None)
        check()
    local = torch.tensor([[0, 2, 3, 5, 9], [1, 2, 4, 6, 7], [0, 1, 2, 3, 4], [3, 4, 5, 6, 8]])
    store.keep(local, torch.tensor([5, 4, 5, 3]))
    check()
    store.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4), 20, None)
    check()


# ---------------------------------------------------------------------------------------------- layer inputs
@dataclass(frozen=True)
class _InputNorm(Scorer):
    """A learned-scorer stand-in: the norm of each new token's layer input (records what it saw)."""

    name: ClassVar[str] = "input_norm"
    NEEDS: ClassVar[frozenset[str]] = frozenset({LAYER_INPUTS})
    seen: list = None  # type: ignore[assignment]

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        self.seen.append((step.layer_idx, step.inputs().clone()))
        return step.view.positions.float()


def test_scorers_receive_each_layers_normed_attention_inputs():
    model = build_model("llama")
    captured: list = []
    policy = Policy(scorer=_InputNorm(seen=captured), budget=8, name="input_norm")
    cache = kvsieve.KVCache(model, policy)
    ids = prompt(length=20)
    expected = {}
    spec = architecture_of(model)
    hooks = []
    for idx, layer in enumerate(decoder_layers(model, spec)):
        hooks.append(layer.input_layernorm.register_forward_hook(
            lambda mod, args, out, idx=idx: expected.__setitem__(idx, out.clone())))
    model(ids, **cache_kwargs(model, cache))
    for h in hooks:
        h.remove()
    assert [idx for idx, _ in captured] == list(range(model.config.num_hidden_layers))
    for idx, inputs in captured:
        assert torch.equal(inputs, expected[idx])
    # a model without a kvsieve cache is unaffected by the (stateless) hook
    plain = build_model("llama")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_statistics_not_declared_are_refused(model):
    @dataclass(frozen=True)
    class Sneaky(Scorer):
        name: ClassVar[str] = "sneaky"

        def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
            return step.window_rows(4).sum(2)[:, :: step.groups]

    cache = kvsieve.KVCache(model, Policy(scorer=Sneaky(), budget=4, name="sneaky"))
    with pytest.raises(RuntimeError, match="window_rows"):
        model(prompt(length=12), **cache_kwargs(model, cache))


def test_deepcopy_is_independent_and_stays_bound_to_the_model(model):
    import copy

    cache = kvsieve.KVCache(model, "h2o", budget=10, schedule="decode")
    ids = prompt(length=24)
    model(ids, **cache_kwargs(model, cache))
    clone = copy.deepcopy(cache)
    assert clone.model_config is cache.model_config and clone.engine.layers is clone.layers
    before = [cache.kept_positions(i, 0, 0).clone() for i in cache.info.managed_layers]
    token = prompt(length=1, seed=3)
    for _ in range(3):
        model(token, **cache_kwargs(model, clone))
    assert clone.get_seq_length() == 27 and cache.get_seq_length() == 24
    after = [cache.kept_positions(i, 0, 0) for i in cache.info.managed_layers]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
