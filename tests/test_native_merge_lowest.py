"""EMS's every-step decoding compaction in one C pass (``native/merge.c``, ``engine/merge_in_place.py``) against the
engine's general step: the same decisions (kept positions, merge counts, tokens), the Global-Local side data bit for
bit, keys, values and logits within float32 rounding; near ties and everything the pass does not take go to the
general step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import _COMMON, ALL_ARCHS, EAGER_ARCHS, build_model
from helpers import decode_loop, prompt
from transformers import LlamaConfig, LlamaForCausalLM

import kvsieve
from kvsieve.cache.store import LayerStore
from kvsieve.core.step import MERGE_COUNT
from kvsieve.engine.merge_in_place import SIDES, MergeInPlace
from kvsieve.native import merge_lowest
from kvsieve.ops.rope import rotary_table, rotate

pytestmark = pytest.mark.skipif(not merge_lowest.available(), reason="no C compiler: the general step only")

STEPS = 14


def _decode(arch: str, dtype: torch.dtype, batch: int, in_place: bool, monkeypatch, budget: int = 24,
            params: dict | None = None, near: float | None = None, model: torch.nn.Module | None = None,
            reset: Callable[[kvsieve.KVCache, torch.nn.Module], None] | None = None):
    """Greedy decoding under ``ems`` with ``schedule="decode"``, the pass on or off: tokens, logits, each managed
    layer's held state, the counters, and what ``merge_lowest`` returned at each call."""
    results: list[bool | None] = []
    real = LayerStore.merge_lowest

    def spy(self, *args):
        out = real(self, *args)
        results.append(out)
        return out

    monkeypatch.setattr(LayerStore, "merge_lowest", spy)
    monkeypatch.setattr(MergeInPlace, "applies", staticmethod(lambda policy: in_place and type(policy.action)
                                                              .__name__ == "EvictThenMerge"))
    model = (model if model is not None else build_model(arch)).to(dtype)
    cache = kvsieve.KVCache(model, "ems", budget=budget, schedule="decode", **{"window": 8, **(params or {})})
    tokens, logits = decode_loop(model, cache, prompt(batch, 40, seed=5), STEPS,
                                 after_step=None if reset is None else lambda step: reset(cache, model))
    state = []
    for layer in cache.layers:
        store = layer.store
        if store is None or SIDES[0] not in store.extras:  # a layer left alone (a sliding-window one)
            continue
        view = store.dense()
        extras = {name: view.extras[name].clone() for name in (*SIDES, MERGE_COUNT)}
        state.append((view.positions.clone(), view.keys.float().clone(), view.values.float().clone(), extras))
    counters = [cache.compactions, *(value for layer in cache.layers for value in (layer.seen, layer.forwards))]
    monkeypatch.undo()
    return tokens, torch.stack(logits), state, counters, results


def _assert_same_decisions(fast, general, dtype: torch.dtype) -> None:
    assert torch.equal(fast[0], general[0])  # the same tokens
    assert fast[3] == general[3]  # the same counters
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(fast[1], general[1], **tolerance)
    for (pos, keys, values, extras), (pos2, keys2, values2, extras2) in zip(fast[2], general[2], strict=True):
        assert torch.equal(pos, pos2)  # the same entries kept in every head
        assert torch.equal(extras[MERGE_COUNT], extras2[MERGE_COUNT])  # the same merges
        torch.testing.assert_close(keys, keys2, **tolerance)
        torch.testing.assert_close(values, values2, **tolerance)
        for name in SIDES:
            torch.testing.assert_close(extras[name], extras2[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_decoding_makes_the_general_steps_decisions(arch, monkeypatch):
    with torch.inference_mode():
        fast = _decode(arch, torch.float32, 2, True, monkeypatch)
        general = _decode(arch, torch.float32, 2, False, monkeypatch)
    assert general[4] == []
    if arch in EAGER_ARCHS:  # soft-capping or sinks: the general step's explicit attention
        assert fast[4] == []
    else:  # the first decoding step after the prompt's compaction shrinks the buffers: the general step
        assert fast[4][0] is None and fast[4].count(True) >= 0.8 * (len(fast[4]) - 1) > 0
        merged = [counts for *_, extras in fast[2] for counts in [extras[MERGE_COUNT]]]
        assert any(bool((counts > 1).any()) for counts in merged)  # merges happened, not only evictions
    _assert_same_decisions(fast, general, torch.float32)


def test_bfloat16_decoding_makes_the_general_steps_decisions(monkeypatch):
    with torch.inference_mode():
        fast = _decode("llama", torch.bfloat16, 1, True, monkeypatch)
        general = _decode("llama", torch.bfloat16, 1, False, monkeypatch)
    assert fast[4].count(True) > 0
    _assert_same_decisions(fast, general, torch.bfloat16)


@pytest.mark.parametrize("params", [{"gamma": 1.0}, {"tau": 1.0}, {"tau": -1.0}, {"kernel_size": 1},
                                    {"use_global": False}, {"window": 3}],
                         ids=["evict-only", "never-merge", "always-merge", "no-pooling", "local-only", "window-3"])
def test_parameters_make_the_general_steps_decisions(params, monkeypatch):
    with torch.inference_mode():
        fast = _decode("qwen2", torch.float32, 2, True, monkeypatch, params=params)
        general = _decode("qwen2", torch.float32, 2, False, monkeypatch, params=params)
    assert fast[4].count(True) > 0
    _assert_same_decisions(fast, general, torch.float32)
    if params in ({"gamma": 1.0}, {"tau": 1.0}):  # nothing merges
        assert all(bool((extras[MERGE_COUNT] == 1).all()) for *_, extras in fast[2])


def test_a_near_tie_goes_to_the_general_step(monkeypatch):
    """Equal scores everywhere (s_glo and s_loc's past part set huge after each step, so that a row adds nothing, and
    no pooling): the pass observes, returns False, and the general step plans — the same result as without the
    pass."""
    def equal_scores(cache):
        for layer in cache.layers:
            if layer.store is not None and SIDES[0] in layer.store.extras:
                for name, value in zip(SIDES, (1e30, 1e30, 0.0, 0.0), strict=True):
                    layer.store.extras[name].fill_(value)

    outcomes = []
    for in_place in (True, False):
        results: list[bool | None] = []
        real = LayerStore.merge_lowest

        def spy(self, *args, results=results, real=real):
            out = real(self, *args)
            results.append(out)
            return out

        with monkeypatch.context() as patch:
            patch.setattr(LayerStore, "merge_lowest", spy)
            patch.setattr(MergeInPlace, "applies", staticmethod(lambda policy, on=in_place: on))
            with torch.inference_mode():
                model = build_model("llama")
                cache = kvsieve.KVCache(model, "ems", budget=24, schedule="decode", window=8, kernel_size=1)
                tokens, logits = decode_loop(model, cache, prompt(1, 40, seed=5), 4,
                                             after_step=lambda step, cache=cache: equal_scores(cache))
        outcomes.append((tokens, torch.stack(logits), [layer.store.dense().positions.clone()
                                                       for layer in cache.layers if layer.store is not None], results))
    fast, general = outcomes
    assert False in fast[3] and True not in fast[3]
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    assert all(torch.equal(a, b) for a, b in zip(fast[2], general[2], strict=True))


def test_only_emss_own_parts_take_the_pass():
    from dataclasses import dataclass

    from kvsieve.parts.actions.evict_merge import EvictThenMerge
    from kvsieve.parts.scorers.global_local import GlobalLocal

    @dataclass(frozen=True)
    class OtherMerge(EvictThenMerge):
        pass

    @dataclass(frozen=True)
    class OtherScore(GlobalLocal):
        pass

    model = build_model("llama")

    def merges(preset: str = "ems", **params) -> bool:
        cache = kvsieve.KVCache(model, preset, budget=24, schedule="decode", window=8, **params)
        return cache.engine._merge is not None

    assert merges()
    assert not merges("ems_pos")  # its centres expand to their positions at attention time
    assert not merges(action=OtherMerge())
    assert not merges(scorer=OtherScore())
    assert not merges(allocator="pyramid")  # a budget per layer from the allocator's arithmetic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [{}, {"tau": -1.0}], ids=["default", "always-merge"])
def test_wide_heads_make_the_general_steps_decisions(dtype, params, monkeypatch):
    """64-dimensional heads: the redundancy's AVX-512 loops run over whole registers of rotary pairs and values (the
    shared tiny models' 16-dimensional heads take only its tails)."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**_COMMON, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 64}, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.inference_mode():
        fast = _decode("llama", dtype, 2, True, monkeypatch, params=params, model=model)
        general = _decode("llama", dtype, 2, False, monkeypatch, params=params, model=model)
    assert fast[4].count(True) >= 0.8 * (len(fast[4]) - 1) > 0
    assert any(bool((extras[MERGE_COUNT] > 1).any()) for *_, extras in fast[2])
    _assert_same_decisions(fast, general, dtype)


def _nearly_collinear(cache: kvsieve.KVCache, model: torch.nn.Module) -> None:
    """Every managed layer's stored keys set to one raw key plus a small wobble per position (1e-3 of it), rotated
    at their positions, and every value to one vector: each to-be-merged entry's redundancies against the centres
    all lie within ~1e-6 of 1 — inside float32's margin of one another (what a layer of nearly collinear keys gives
    on the real model), far apart in float64."""
    generator = torch.Generator().manual_seed(3)
    for index, layer in enumerate(cache.layers):
        store = layer.store
        if store is None or SIDES[0] not in store.extras:
            continue
        view = store.dense()
        dim = view.keys.shape[-1]
        raw_key, value = torch.randn(2, dim, generator=generator)
        wobble = 1e-3 * torch.randn(int(view.positions.max()) + 1, dim, generator=generator)
        keys = rotate(raw_key + wobble[view.positions], view.positions, rotary_table(model.config, index))
        view.keys.copy_(keys.to(view.keys.dtype))
        view.values.copy_(value.to(view.values.dtype).expand_as(view.values))


def test_redundancies_within_float32s_margin_are_decided_in_float64(monkeypatch):
    """Redundancies that tie in float32 (within 2e-5 of one another): the pass decides them on the float64
    redundancy, as the general step does, instead of handing the step to the general step."""
    with torch.inference_mode():
        fast = _decode("llama", torch.float32, 2, True, monkeypatch, reset=_nearly_collinear)
        general = _decode("llama", torch.float32, 2, False, monkeypatch, reset=_nearly_collinear)
    assert fast[4][0] is None and fast[4].count(True) >= 0.8 * (len(fast[4]) - 1) > 0
    assert all(bool((extras[MERGE_COUNT] > 1).any()) for *_, extras in fast[2])  # merged, not evicted
    _assert_same_decisions(fast, general, torch.float32)


def _scores_a_millionth_apart(cache: kvsieve.KVCache, model: torch.nn.Module) -> None:
    """Each head's Global-Local side data set so that its scores are 1e8·(1 + 1e-6·k) over a shuffled k (s_glo and
    s_loc's past part alike, the current part and its row count zero: a decoding row, below half an ulp of 1e8, adds
    nothing, and the merges' weights stay far from float32's overflow): the lowest two lie 1e-6 apart, relative —
    within float32's rounding of two summation orders, outside the float64 scores'."""
    generator = torch.Generator().manual_seed(4)
    for layer in cache.layers:
        store = layer.store
        if store is None or SIDES[0] not in store.extras:
            continue
        view = store.dense()
        length = view.positions.shape[-1]
        spaced = 1e8 * (1.0 + 1e-6 * torch.randperm(length, generator=generator).double()).float()
        for name, value in zip(SIDES, (spaced, spaced, 0.0, 0.0), strict=True):
            view.extras[name].copy_(torch.as_tensor(value).expand_as(view.extras[name]))


def test_scores_a_millionth_apart_are_decided_by_the_pass(monkeypatch):
    """The scores are Eq. 2 and the pooling in float64, rounded once (GlobalLocal.raw and merge.c alike): the same
    float32 scores on both sides, so two lowest scores 1e-6 apart (a float32 near tie before) are decided by the pass
    as the general step decides them."""
    with torch.inference_mode():
        fast = _decode("llama", torch.float32, 2, True, monkeypatch, params={"kernel_size": 1},
                       reset=_scores_a_millionth_apart)
        general = _decode("llama", torch.float32, 2, False, monkeypatch, params={"kernel_size": 1},
                          reset=_scores_a_millionth_apart)
    assert fast[4].count(True) >= 0.9 * (len(fast[4]) - 3) > 0  # the general step for exact ties only
    _assert_same_decisions(fast, general, torch.float32)
