"""Every-step decoding eviction in place (``kvsieve.native.evict_lowest``, ``LayerStore.drop_lowest`` and the engine's
``_evicting_step``): the observation, the drop-one plan and the drop of the PyTorch path, bit for bit — the
accumulated sums, the dropped entries, every buffer and the layout; a tie or NaN among the lowest sums moves nothing
and leaves the plan to the general path; anything it does not take is declined with nothing changed; and a model
decodes the same tokens, logits and cache with it as without it, on every architecture, in float32 and bfloat16."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ALL_ARCHS, EAGER_ARCHS, build_model
from helpers import decode_loop, prompt
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsieve
from kvsieve.cache.store import LayerStore, SideSpec
from kvsieve.cache.store_append import GROWTH
from kvsieve.native import evict_lowest
from kvsieve.ops.gqa import reduce_groups

pytestmark = pytest.mark.skipif(evict_lowest._kernel() is None, reason="no C compiler: the PyTorch path only")
ACC = "acc"
#: The free rows a store of ``_store`` keeps after dropping one entry per segment (a fresh append's growth, and one).
RESERVE = GROWTH + 1


def _store(batch: int, heads: int, length: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> LayerStore:
    generator = torch.Generator().manual_seed(seed)
    store = LayerStore(batch, heads, 8, dtype, torch.device("cpu"))
    store.ensure_extra(ACC)
    store.ensure_side(SideSpec("other", (2,)))
    shape = (batch, heads, length, 8)
    store.append(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype),
                 5, None)
    store.add_dense(ACC, torch.rand(batch, heads, length, generator=generator))
    store.add_dense("other", torch.rand(batch, heads, length, 2, generator=generator))
    return store


def _rows(batch: int, q_heads: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, q_heads, 1, length, generator=generator) * 3, dim=-1)


def _snapshot(store: LayerStore) -> list[torch.Tensor]:
    view = store.dense()
    return [view.keys.clone(), view.values.clone(), view.positions.clone(),
            *(view.extras[name].clone() for name in sorted(view.extras))]


def _pytorch_path(store: LayerStore, rows: torch.Tensor, candidates: int) -> torch.Tensor | None:
    """The engine's general route: observation (``add_dense`` of the group mean), ``_drop_one``'s minimum with its
    uniqueness check, ``drop_one``. Returns the dropped indices, or None for a tie (the sums added, nothing moved)."""
    store.add_dense(ACC, reduce_groups(rows[:, :, 0], store.heads, "mean"))
    return _pytorch_scored(store, store.dense().extras[ACC], candidates)


@given(batch=st.integers(1, 3), heads=st.integers(1, 3), groups=st.sampled_from([1, 2, 3, 4]),
       length=st.integers(2, 40), newest=st.integers(0, 40), bf16=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_pass_equals_the_pytorch_observation_plan_and_drop(batch, heads, groups, length, newest, bf16, seed):
    candidates = max(1, length - newest)
    store = _store(batch, heads, length, torch.bfloat16 if bf16 else torch.float32, seed)
    expected = copy.deepcopy(store)
    rows = _rows(batch, heads * groups, length, seed + 1)
    capacity = store.keys.shape[0]
    want = _pytorch_path(expected, rows, candidates)
    got = store.drop_lowest(rows, ACC, candidates, capacity // (batch * heads) - length + 1)
    assert got is (want is not None)
    assert store.max_length == expected.max_length == (length - 1 if got else length)
    assert store.keys.shape[0] == capacity  # in place: the same buffers, the freed row is the next append's
    for mine, theirs in zip(_snapshot(store), _snapshot(expected), strict=True):
        assert torch.equal(mine, theirs)


def _pytorch_scored(store: LayerStore, scores: torch.Tensor, candidates: int) -> torch.Tensor | None:
    """``_drop_one``'s minimum of given scores (shared ones expanded over the heads), its check, ``drop_one``."""
    candidate = scores.expand(-1, store.heads, -1)[..., :candidates]
    lowest, dropped = candidate.min(dim=-1)
    if not torch.equal((candidate == lowest[..., None]).sum(dim=-1), torch.ones_like(dropped)):
        return None
    with store.reserving(1):
        store.drop_one(dropped.reshape(-1))
    return dropped.reshape(-1)


@given(batch=st.integers(1, 3), heads=st.integers(1, 3), length=st.integers(2, 40), newest=st.integers(0, 40),
       shared=st.booleans(), ties=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_given_scores_drop_as_the_pytorch_plan_and_drop(batch, heads, length, newest, shared, ties, seed):
    candidates = max(1, length - newest)
    store = _store(batch, heads, length, seed=seed)
    expected = copy.deepcopy(store)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, 1 if shared else heads, length, generator=generator)
    if ties:  # few distinct values: lowest scores often tied
        scores = (scores * 3).floor()
    want = _pytorch_scored(expected, scores, candidates)
    got = store.drop_lowest_scored(scores, candidates, RESERVE)
    assert got is (want is not None)
    for mine, theirs in zip(_snapshot(store), _snapshot(expected), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("aligned", [True, False])
def test_shared_scores_need_heads_holding_the_same_positions(aligned):
    """Scores shared by a batch item's heads (TOVA's layer average) are the general path's only where the heads hold
    the same positions: otherwise the pass declines with nothing changed (the general path averages per group)."""
    store = _store(2, 3, 8)
    local = torch.arange(8)[None, :].repeat(6, 1)
    if not aligned:
        local[4] = torch.tensor([0, 1, 2, 3, 4, 5, 7, 6])  # item 1, head 1 keeps position 12 in place of 11
    with store.reserving(0):
        store.keep(local, torch.full((6,), 7))
    assert store.is_uniform
    before = _snapshot(store)
    got = store.drop_lowest_scored(_rows(2, 1, 7)[:, :, 0], 7, 1)
    if aligned:
        assert got is True and store.max_length == 6
    else:
        assert got is None and all(torch.equal(a, b) for a, b in zip(_snapshot(store), before, strict=True))


def test_a_tie_adds_the_sums_and_moves_nothing():
    store = _store(2, 3, 10)
    acc = store.dense().extras[ACC]
    acc[1, 2, 3] = acc[1, 2, 7] = -1.0  # two lowest sums in one segment; equal rows keep them equal
    rows = torch.full((2, 6, 1, 10), 0.1)
    before = _snapshot(store)
    expected = copy.deepcopy(store)
    assert _pytorch_path(expected, rows, 10) is None
    assert store.drop_lowest(rows, ACC, 10, RESERVE) is False
    after = _snapshot(store)
    for index, (now, then) in enumerate(zip(after, before, strict=True)):
        if index == 3:  # the accumulator (first side data by name): the sums were added
            assert torch.equal(now, expected.dense().extras[ACC]) and not torch.equal(now, then)
        else:
            assert torch.equal(now, then)
    assert store.drop_lowest(rows, ACC, 7, RESERVE) is True  # the tie lies past the candidates: entry 3 is the lowest
    assert store.dense().positions[1, 2].tolist() == [5, 6, 7, 9, 10, 11, 12, 13, 14]


def test_nan_moves_nothing():
    store = _store(1, 2, 6)
    store.dense().extras[ACC][0, 1, 4] = float("nan")
    before = _snapshot(store)
    assert store.drop_lowest(_rows(1, 2, 6), ACC, 6, RESERVE) is False
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(_snapshot(store), before, strict=True)) if i != 3)


@pytest.mark.parametrize("case", ["ragged", "hook", "deferred", "strided_rows", "candidates_0", "candidates_over",
                                  "capacity", "no_side", "no_library"])
def test_declined_with_nothing_changed(case, monkeypatch):
    store = _store(2, 2, 8)
    rows = _rows(2, 4, 8)
    candidates, name, reserve = 8, ACC, RESERVE
    if case == "ragged":
        store.keep(torch.arange(8).expand(4, 8), torch.tensor([8, 7, 8, 8]))
        rows = rows[..., :8]
    elif case == "hook":
        store.hooks.append(object())  # type: ignore[arg-type]
    elif case == "deferred":
        store._deferred = {ACC: object()}  # type: ignore[dict-item]
    elif case == "strided_rows":
        rows = _rows(2, 4, 16)[..., ::2]
    elif case == "candidates_0":
        candidates = 0
    elif case == "candidates_over":
        candidates = 9
    elif case == "capacity":
        reserve = RESERVE + 1
    elif case == "no_side":
        name = "missing"
    else:
        monkeypatch.setattr(evict_lowest, "_kernel", lambda: None)
    deferred, store._deferred = store._deferred, {}
    before = _snapshot(store)
    store._deferred = deferred
    assert store.drop_lowest(rows, name, candidates, reserve) is None
    store._deferred = {}
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(store), before, strict=True))


IN_PLACE_POLICIES = [("h2o", {}), ("tova", {}), ("tova", {"heads": "group"})]


def _decode(arch: str, dtype: torch.dtype, batch: int, in_place: bool, monkeypatch, tie: bool = False,
            policy: str = "h2o", params: dict | None = None):
    """Greedy decoding of a cache evicting at every step, with the in-place pass on or off; the tokens, logits, each
    layer's entries and side data, the counters, and what ``drop_lowest`` (H2O) or ``drop_lowest_scored`` (TOVA)
    returned at each call, with the decoding forward it came in."""
    results: list[tuple[int, bool | None]] = []
    forward = [0]
    for name in ("drop_lowest", "drop_lowest_scored"):
        real = getattr(LayerStore, name)

        def spy(self, *args, real=real):
            out = real(self, *args)
            results.append((forward[0], out))
            return out

        monkeypatch.setattr(LayerStore, name, spy)
    monkeypatch.setattr(evict_lowest, "available", (lambda: True) if in_place else (lambda: False))
    model = build_model(arch).to(dtype)
    cache = kvsieve.KVCache(model, policy, budget=24, schedule="decode", **(params or {}))

    def flatten_sums(step: int) -> None:  # every sum huge: adding a row changes none, every lowest is tied
        forward[0] = step + 1  # the decoding forward that comes next
        if tie and step == 0:
            for layer in cache.layers:
                if layer.store is not None and "h2o_acc" in layer.store.side_names():
                    layer.store.extras["h2o_acc"].fill_(1e30)

    tokens, logits = decode_loop(model, cache, prompt(batch, 40, seed=3), 12, after_step=flatten_sums)
    state = [_snapshot(layer.store) for layer in cache.layers if layer.store is not None]
    state.append([torch.tensor([cache.compactions, *(value for layer in cache.layers
                                                      for value in (layer.seen, layer.forwards))])])
    monkeypatch.undo()
    return tokens, torch.stack(logits), state, results


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("policy", "params"), IN_PLACE_POLICIES, ids=["h2o", "tova", "tova-group"])
def test_decoding_equals_the_general_step_bit_for_bit(arch, dtype, policy, params, monkeypatch):
    batch = 3 if dtype == torch.float32 else 1
    with torch.inference_mode():
        fast = _decode(arch, dtype, batch, True, monkeypatch, policy=policy, params=params)
        general = _decode(arch, dtype, batch, False, monkeypatch, policy=policy, params=params)
    if arch in EAGER_ARCHS:  # soft-capping or sinks: the general step's explicit attention, pass or not
        assert fast[3] == general[3] == []
    else:  # every step dropped in place but the first (the prompt's compaction left no free row: drop_one's
        assert general[3] == [] and {forward for forward, _ in fast[3]} == set(range(1, 13))  # gather shrinks it)
        later = [result for forward, result in fast[3] if forward > 1]
        assert all(result is None for forward, result in fast[3] if forward == 1) and None not in later
        assert later.count(True) >= 0.9 * len(later)  # the rest: a tie (equal keys give TOVA equal scores)
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    for mine, theirs in zip(fast[2], general[2], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_tied_lowest_sums_take_the_general_plan(monkeypatch):
    with torch.inference_mode():
        fast = _decode("llama", torch.float32, 2, True, monkeypatch, tie=True)
        general = _decode("llama", torch.float32, 2, False, monkeypatch, tie=True)
    assert {forward for forward, _ in fast[3]} == set(range(1, 13))  # each tie went to top-k, as the general path's
    assert all(result is None if forward == 1 else result is False for forward, result in fast[3])
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    for mine, theirs in zip(fast[2], general[2], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_only_the_declaring_scorer_takes_the_pass():
    """The pass computes H2O's observation and protection, or TOVA's scores from the row: a policy whose scorer
    observes, scores or protects otherwise — a subclass overriding any of them, another scorer, another schedule's
    budget arithmetic — does not take it."""
    from dataclasses import dataclass

    from kvsieve.engine.layer_plans import LayerPlans
    from kvsieve.parts.scorers.h2o import AccumulatedAttention
    from kvsieve.parts.scorers.tova import LastQueryAttention
    from kvsieve.policies.policy import Policy

    @dataclass(frozen=True)
    class Reweighted(AccumulatedAttention):
        def raw(self, step, nominal):
            return super().raw(step, nominal) * 2

    @dataclass(frozen=True)
    class Protecting(LastQueryAttention):
        def protect(self, scores, step, nominal):
            return super().protect(scores, step, nominal)

    info = kvsieve.KVCache(build_model("llama"), "h2o", budget=24).info

    def plans(scorer) -> LayerPlans:
        return LayerPlans(Policy(scorer=scorer, budget=24), info)

    assert plans(AccumulatedAttention()).accumulator() == "h2o_acc"
    assert plans(Reweighted()).accumulator() is None and not plans(Reweighted()).scores_from_row()
    assert plans(LastQueryAttention()).scores_from_row() and plans(LastQueryAttention()).accumulator() is None
    assert not plans(Protecting()).scores_from_row()

    def in_place(policy: str, **params) -> str | None:
        return kvsieve.KVCache(build_model("llama"), policy, budget=24, schedule="decode", **params).engine._in_place

    assert in_place("h2o") == "h2o_acc" and in_place("tova") == "" and in_place("h2o_caote") is None
    assert in_place("ems", window=8) is None and in_place("random") is None
    assert plans(AccumulatedAttention()).lowest_candidates(0, 25) is None  # prefill: no decoding compaction
    decode = kvsieve.KVCache(build_model("llama"), "h2o", budget=24, schedule="decode").engine._plans
    assert decode.lowest_candidates(0, 25) == 13 and decode.lowest_candidates(0, 24) is None  # 12 newest protected
