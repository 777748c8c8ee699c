"""Property-based tests: random policy × parameters × architecture × left-padded batch × schedule × decoding
steps × second turn, on the tiny models (hypothesis, derandomized: the same examples on every run).

For each drawn configuration the batch runs through the public API (prompt, decoding steps, optionally a
second multi-token turn and more steps) and every property below is checked:

* **budgets** — after every forward, every managed head within its budget: uniform allocators ≤ the
  layer budget (+ the decoding steps since the last prompt under ``prefill``, + ``buffer`` under
  ``decode``/``blockwise``); adaptive: per row and layer ``Σ heads ≤ H·B``; global: per row over every
  managed layer ``Σ ≤ Σ_l H·B_l``; ``blockwise`` peaks ≤ ``B + block_size`` (+ ``buffer`` after decoding
  steps) through ``peak_head_length()``. At every compaction: protected (``+inf``) entries are kept,
  padding is not, and the counts are the allocator's rule (uniform: ``min(max(target, protected), held)``;
  adaptive/global: between ``min(total, held)`` and ``max(total, Σ min(max(target, protected), held))``),
  with ``target`` the layer budget or ``⌈n·(1 - ratio)⌉`` of the decimal ratio;
* **kept positions** strictly increasing, real (never a padding slot) and < tokens seen; models that do
  not evict hold every token;
* **finite logits**;
* **determinism** — the same inputs on a fresh cache give identical kept positions and bit-identical
  logits; and the same run without inspecting the cache between forwards gives the same results, unless a
  second turn directly follows the prompt (uninspected, it continues the prompt: one compaction);
* **row independence** — each row equals that row run alone (kept positions exactly, logits within 1e-4),
  up to near-ties of float noise (see ``test_row_independence.compare_row``), inspected after every
  forward and not, except for the row dependences listed in ``test_row_independence.KNOWN_ROW_DEPENDENCE``
  (causes outside the allocators, each with a strict-xfail reproducer there);
* **the model is left as it was** — afterwards the same model instance with a ``DynamicCache`` gives
  logits ``torch.equal`` to an untouched copy's (:func:`test_model_unchanged_after_kvsieve`), and the same
  with a ``StaticCache`` (:func:`test_model_unchanged_after_kvsieve_static_cache`, a separate test so it can
  be disabled on its own: set ``STATIC_CACHE_CHECK = False``).

Prompts are ≤ 40 distinct tokens (a prompt repeating one token makes CAOTE/ReST-KV scores float noise
around 0, whose order no tolerance can tell from a dependence). Known bugs outside the allocators are
switched off in the checks by ``BLOCK_OF_ONE_IS_A_DECODING_STEP`` and ``KNOWN_ROW_DEPENDENCE``.

Runtime: ``MAX_EXAMPLES`` = 25 examples per preset (18 presets; fewer for the cache-compatibility tests),
about 32 s on one CPU thread. ``KVSIEVE_PROPERTY_EXAMPLES=500`` runs a longer hunt (~15 min).
"""

from __future__ import annotations

import itertools
import math
import os
from fractions import Fraction
from typing import Any

import pytest
import torch
from conftest import ARCHS, GEMMA3_SLIDING_WINDOW, get_model
from helpers import left_pad
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from test_row_independence import Program, RunResult, compare_row, known_row_dependence, one_query_blocks, run_rows
from transformers import DynamicCache, StaticCache

import kvsieve
from kvsieve.core.part import PolicyConfigError
from kvsieve.parts.allocators.adaptive import Adaptive
from kvsieve.parts.allocators.global_budget import GlobalBudget
from kvsieve.parts.allocators.pyramid import Pyramid
from kvsieve.parts.allocators.two_stage import TwoStageSplit, stage1_keep
from kvsieve.parts.scorers.duo_attention import HeadSplit
from kvsieve.transformers_adapter import cache_kwargs

pytestmark = pytest.mark.compat  # runs in the transformers-version matrix (scripts/compat_matrix.sh)

#: Examples per preset (18 presets); ``KVSIEVE_PROPERTY_EXAMPLES`` overrides it for a longer hunt.
MAX_EXAMPLES = int(os.environ.get("KVSIEVE_PROPERTY_EXAMPLES", "25"))
STATIC_EXAMPLES = 4
#: Flip to False to disable the StaticCache property on its own.
STATIC_CACHE_CHECK = True
MAX_PROMPT = 40
VOCAB_IDS = st.integers(3, 127)  # no pad/bos/eos

SETTINGS = settings(
    derandomize=True,
    database=None,
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large],
)

ADAKV_BASES = ("snapkv", "h2o", "tova", "streaming_llm", "restkv", "snapkv_caote", "h2o_fastcaote", "random")

# ---------------------------------------------------------------------------------------------- strategies


@st.composite
def policies(draw: st.DrawFn, name: str) -> tuple[str, dict[str, Any], kvsieve.Policy]:
    """Parameters that make a valid policy of preset ``name`` (invalid draws are rejected)."""
    preset = kvsieve.list_policies()[name]
    params: dict[str, Any] = {}
    if name == "adakv":
        params["base"] = draw(st.sampled_from(ADAKV_BASES))
    base = kvsieve.list_policies()[params["base"]].scorer if "base" in params else None
    accepted = preset.parameters(**({"scorer": base} if base is not None else {}))
    evicts = preset.scorer is not None
    if evicts or preset.selector is not None:
        if evicts and draw(st.integers(0, 3)) == 0:
            params["ratio"] = draw(st.integers(0, 99)) / 100  # a decimal ratio
        else:
            params["budget"] = draw(st.integers(1, 24))
    budget = params.get("budget")
    if "window" in accepted and name != "random":
        params["window"] = draw(st.integers(0, min(budget, 8) if budget is not None else 8))
    elif name == "random":
        params["window"] = draw(st.sampled_from([0, 0, 1, 3]))
        params["seed"] = draw(st.integers(0, 3))
    if "recent_ratio" in accepted:
        params["recent_ratio"] = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    if "sinks" in accepted:
        params["sinks"] = draw(st.integers(0, min(budget, 4) if budget is not None else 4))
    if "pooling" in accepted and draw(st.booleans()):
        params["pooling"] = draw(st.sampled_from(["avgpool", "maxpool"]))
        params["kernel_size"] = draw(st.sampled_from([1, 3, 5, 7]))
    if "floor" in accepted and isinstance(preset.allocator, GlobalBudget):
        params["floor"] = draw(st.integers(0, 2))  # entries per head before the global ranking
    elif "floor" in accepted:
        params["floor"] = draw(st.sampled_from(["outside_window", "budget"]))
        params["floor_alpha"] = draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]))
    if "heads" in accepted:
        params["heads"] = draw(st.sampled_from(["layer", "group"]))
    if evicts and draw(st.integers(0, 4)) == 0:
        params["allocator"] = draw(st.sampled_from(["uniform", "pyramid", "adaptive", "global"]))
    if evicts and draw(st.integers(0, 7)) == 0:
        params["expand_gqa"] = True
    if preset.action is not None and preset.action.quantizes and draw(st.integers(0, 2)) == 0:  # tiers + a selector
        params["selector"] = draw(st.sampled_from(["quest", "sparq", "hsa", "exact_topk"]))
    try:
        kvsieve.make_policy(name, **params)
    except PolicyConfigError:
        assume(False)
    schedules = kvsieve.make_policy(name, **params).schedules()
    if budget is None:
        schedules = tuple(s for s in schedules if s == "prefill")
    assume(schedules)
    schedule = draw(st.sampled_from(schedules))
    if schedule != "prefill":
        params["schedule"] = schedule
        params["buffer"] = draw(st.integers(0, 4))
    if schedule == "blockwise":
        params["block_size"] = draw(st.integers(1, 12))
    try:
        policy = kvsieve.make_policy(name, **params)
    except PolicyConfigError:
        assume(False)
    return name, params, policy


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[torch.Tensor], Program]:
    """1–3 prompts (left-padded together), decoding steps, an optional second turn and more steps."""
    batch = draw(st.sampled_from([1, 2, 2, 3, 3]))
    # distinct tokens within a prompt: a prompt repeating one token has identical values, hence scores
    # that are float noise around 0 (CAOTE, ReST-KV), whose order no tolerance can tell apart from a bug
    prompts = st.lists(VOCAB_IDS, min_size=1, max_size=MAX_PROMPT, unique=True)
    rows = [torch.tensor(draw(prompts)) for _ in range(batch)]
    steps: list[tuple[str, Any]] = [("decode", t) for t in draw(st.lists(VOCAB_IDS, max_size=4))]
    if draw(st.booleans()):
        steps.append(("extend", torch.tensor([draw(st.lists(VOCAB_IDS, min_size=2, max_size=10))])))
        steps += [("decode", t) for t in draw(st.lists(VOCAB_IDS, max_size=2))]
    return rows, Program(steps)


# ---------------------------------------------------------------------------------------------- checks


def ratio_target(n: int, ratio: float) -> int:
    """``⌈n·(1 - ratio)⌉`` with the decimal ratio, exactly."""
    return math.ceil(n * (1 - Fraction(repr(ratio))))


def layer_target(policy: kvsieve.Policy, cache: kvsieve.KVCache, layer: int, held: int,
                 row_held: int | None = None) -> int:
    """The per-head budget of ``layer`` for a head holding ``held`` (its row's longest head ``row_held``;
    None: an upper bound over every length)."""
    if policy.budget is None:
        assert policy.ratio is not None
        return ratio_target(held, policy.ratio)
    if isinstance(policy.allocator, TwoStageSplit):  # RocketKV's stage 1 keeps ⌈N / c^r⌉ of the N held
        return int(stage1_keep(torch.tensor([held]), policy.budget)[0])
    window = policy.scorer.protected_window() if policy.scorer is not None else 0
    target = policy.allocator.layer_budget(policy.budget, layer, cache.info.num_layers, window)
    if isinstance(policy.allocator, Pyramid) and policy.allocator.reference_regimes:
        # the reference's regimes, by the row's prompt: all of n ≤ B, a uniform B below 2 (B - w)
        if row_held is None:
            return max(target, policy.budget)
        if row_held <= policy.budget:
            return held
        if row_held < 2 * (policy.budget - window):
            return policy.budget
    return target


def check_positions(run: RunResult, rows: list[torch.Tensor]) -> None:
    """Kept positions strictly increasing, real and < tokens seen; non-evicting policies hold everything."""
    seen = run.seen[-1]
    policy = run.cache.policy
    sliding = run.cache.info.sliding_windows
    for (layer, b, _h), kept in run.kept.items():
        own = seen - run.pads[b]  # tokens of this row
        assert all(0 <= p < own for p in kept), (layer, b, kept, own)
        assert all(x < y for x, y in itertools.pairwise(kept)), (layer, b, kept)
        if sliding[layer] is not None:
            assert len(kept) <= sliding[layer]
            assert not kept or kept[0] >= own - sliding[layer] + 1
        elif not policy.evicts:
            assert kept == list(range(own)), (layer, b, kept)


def check_events(run: RunResult, policy: kvsieve.Policy) -> None:
    """Every compaction keeps its protected entries, no padding, and the allocator's counts."""
    cache = run.cache
    allocator = policy.allocator
    for compaction in run.events:
        inf = torch.isposinf(compaction.scores) & compaction.valid
        assert bool((compaction.kept <= compaction.valid).all()), "a padding slot was kept"
        assert bool((compaction.kept | ~inf).all()), "a protected (+inf) entry was dropped"
        held = compaction.valid.sum(dim=-1)
        kept = compaction.kept.sum(dim=-1)
        protected = inf.sum(dim=-1)
        target = torch.tensor([[layer_target(policy, cache, compaction.layer, int(n), int(row.max())) for n in row]
                               for row in held])
        ceiling = torch.minimum(torch.maximum(target, protected), held)
        if allocator.scope == "global":  # GlobalBudget, CAKE: per-layer counts follow one total
            continue  # layers keeping everything are not planned: the total is checked on head lengths
        # a row compacts only when it is over its own limit (schedules' row_limit): rows the plan leaves whole
        # are checked by the budget bounds on head lengths, not here
        touched = ~(kept == held).all(dim=1)
        if not bool(touched.any()):
            continue
        target, ceiling, held, kept = target[touched], ceiling[touched], held[touched], kept[touched]
        if isinstance(allocator, Adaptive):
            check_total(target, ceiling, held, kept)
        else:
            assert torch.equal(kept, ceiling), (compaction.layer, kept.tolist(), ceiling.tolist())


def check_total(target: torch.Tensor, ceiling: torch.Tensor, held: torch.Tensor, kept: torch.Tensor) -> None:
    """Per row: at least ``min(Σ target, Σ held)``, at most ``max(Σ target, Σ ceiling)``."""
    total, low = kept.sum(dim=1), torch.minimum(target.sum(dim=1), held.sum(dim=1))
    high = torch.maximum(target.sum(dim=1), ceiling.sum(dim=1))
    assert bool((low <= total).all()) and bool((total <= high).all()), (kept.tolist(), target.tolist())


def prompt_continued(rows: list[torch.Tensor], program: Program) -> bool:
    """A second turn right after a multi-token prompt (no decoding step between): one prompt, uninspected."""
    return max(len(r) for r in rows) > 1 and bool(program.steps) and program.steps[0][0] == "extend"


def protected_bound(policy: kvsieve.Policy) -> int:
    """Most entries a head's scorer protects whatever its budget (the window or the sinks)."""
    scorer = policy.scorer
    base = getattr(scorer, "base", None)
    return max((max(s.protected_window(), getattr(s, "sinks", 0)) for s in (scorer, base) if s is not None),
               default=0)


def budget_checker(policy: kvsieve.Policy, rows: list[torch.Tensor], program: Program):
    """``after_forward`` callback asserting the budgets after every forward (budget policies)."""
    kinds = ["prompt"] + [kind for kind, _ in program.steps]
    one_query = BLOCK_OF_ONE_IS_A_DECODING_STEP and one_query_blocks(policy, [len(r) for r in rows], program)
    schedule = policy.schedule.name
    buffer = getattr(policy.schedule, "buffer", 0)
    slack = {"steps": 0}
    reconstructs = bool(getattr(policy.scorer, "RECONSTRUCTS", False))

    def check(cache: kvsieve.KVCache, i: int) -> None:
        lengths = cache.head_lengths()
        managed = list(cache.info.managed_layers)
        for layer, window in enumerate(cache.info.sliding_windows):
            if window is not None:
                assert int(lengths[layer].max()) <= GEMMA3_SLIDING_WINDOW
        multi = kinds[i] != "decode" and (i > 0 or max(len(r) for r in rows) > 1)
        if reconstructs:  # compressed once, after the prompt's reconstruction: every later token is kept
            added = 0 if i == 0 else 1 if kinds[i] == "decode" else int(program.steps[i - 1][1].shape[-1])
            slack["steps"] += added
        else:
            slack["steps"] = 0 if multi else slack["steps"] + 1
        if policy.budget is None or policy.scorer is None:
            return
        if schedule == "prefill":
            extra = slack["steps"]
        elif schedule == "decode":
            extra = buffer
        else:  # blockwise: back to the budget after each block; decoding steps evict past budget + buffer
            extra = 0 if multi and not one_query else buffer
        heads = lengths.shape[2]
        budgets = {layer: layer_target(policy, cache, layer, 0) for layer in managed}
        if isinstance(cache.policy.scorer, HeadSplit):  # DuoAttention: retrieval heads hold everything
            for layer in managed:
                streaming = cache.policy.scorer.streaming_heads(layer, heads, torch.device("cpu"))
                bound = max(budgets[layer], cache.policy.scorer.sinks) + extra
                held = lengths[layer][:, streaming]
                assert held.numel() == 0 or int(held.max()) <= bound, (layer, lengths[layer].tolist())
                assert int(lengths[layer].max()) <= cache.get_seq_length(), lengths[layer].tolist()
        elif policy.action.quantizes:  # the budget counts full-precision entries (bytes); the rest is quantized
            for layer in managed:
                store = cache.layers[layer].store
                full = store.full_lengths() if store is not None else lengths[layer]
                bound = max(budgets[layer], protected_bound(policy)) + extra
                assert int(full.max()) <= bound, (layer, full.tolist(), bound)
                assert int(lengths[layer].max()) <= cache.get_seq_length(), lengths[layer].tolist()
        elif not policy.evicts:  # rocketkv_mt marks its stage-1 choice and holds every entry, whatever the allocator
            assert int(lengths[managed].max()) <= cache.get_seq_length(), lengths.tolist()
        elif policy.allocator.scope == "global":  # one total over the layers (GlobalBudget, CAKE's layer budgets)
            total = sum(heads * budgets[layer] for layer in managed)
            held = lengths[managed].sum(dim=(0, 2))
            allowance = heads * len(managed) * (buffer if schedule == "decode" else slack["steps"])
            assert bool((held <= total + allowance).all()), (held.tolist(), total)
        elif isinstance(policy.allocator, Adaptive):
            for layer in managed:
                held = lengths[layer].sum(dim=-1)
                # prefill: the decoding steps since the last prompt; blockwise: a decoding step evicts as soon
                # as a head exceeds budget + buffer, so no head holds more than that without eviction
                steps = slack["steps"] if schedule == "prefill" else min(slack["steps"], buffer)
                if schedule == "blockwise" and one_query:
                    steps = buffer
                allowance = heads * steps
                assert bool((held <= heads * budgets[layer] + allowance).all()), (layer, held.tolist())
        else:
            protected = protected_bound(policy)  # kept even above a (pyramid) layer budget
            for layer in managed:
                bound = max(budgets[layer], protected) + extra
                if isinstance(policy.allocator, TwoStageSplit):  # stage 1 of at most every token seen
                    seen = torch.arange(cache.get_seq_length() + 1)
                    bound = max(int(stage1_keep(seen, policy.budget).max()), protected) + extra
                assert int(lengths[layer].max()) <= bound, (layer, lengths[layer].tolist(), bound)
        # (DuoAttention's retrieval heads hold every token: its streaming heads' bound is checked above)
        # (rocketkv_mt marks and holds every entry: no blockwise peak either)
        if schedule == "blockwise" and policy.evicts and not isinstance(policy.allocator, Adaptive) \
                and not isinstance(cache.policy.scorer, HeadSplit):
            block = policy.schedule.block_length()
            assert block is not None
            decoded = one_query or any(kind == "decode" for kind in kinds[: i + 1])
            bound = max(max(budgets.values()), protected_bound(policy)) + block + (buffer if decoded else 0)
            assert cache.peak_head_length() <= bound, (cache.peak_head_length(), bound)

    return check


#: Known bug (engine.py): a blockwise block of a single query (``block_size=1``, or the last block of a
#: prompt of ``k·block_size + 1`` tokens) is taken for a decoding step, so the decoding ``buffer`` applies
#: inside prompts (strict xfail :func:`test_blockwise_block_of_one_query_is_not_a_decoding_step`). Set to
#: False once fixed: the budgets are then checked without that allowance.
BLOCK_OF_ONE_IS_A_DECODING_STEP = True


def plain_logits(model: torch.nn.Module, rows: list[torch.Tensor], static: bool) -> list[torch.Tensor]:
    """Prompt + 2 decoding steps of a plain transformers cache on the left-padded batch."""
    ids, mask, _ = left_pad(rows)
    if static:
        cache: Any = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
    else:
        cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **cache_kwargs(model, cache)).logits
        out.append(logits)
        for token in (5, 6):
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
            new = torch.full((len(rows), 1), token)
            out.append(model(new, attention_mask=mask, **cache_kwargs(model, cache)).logits)
    return out


# ---------------------------------------------------------------------------------------------- properties


PRESETS = sorted(kvsieve.list_policies())


def checked_and_deterministic_run(model: torch.nn.Module, rows: list[torch.Tensor], name: str, params: dict[str, Any],
                                  policy: kvsieve.Policy, program: Program) -> RunResult:
    """One run with the budgets checked after every forward, positions, events and finite logits checked, and a
    fresh cache on the same inputs giving the same kept entries and logits (determinism); returns the run."""
    batched = run_rows(model, rows, name, params, program, after_forward=budget_checker(policy, rows, program))
    check_positions(batched, rows)
    check_events(batched, policy)
    for logits in batched.logits:
        assert bool(torch.isfinite(logits).all())
    again = run_rows(model, rows, name, params, program)
    assert again.kept == batched.kept
    assert all(torch.equal(x, y) for x, y in zip(again.logits, batched.logits, strict=True))
    return batched


@pytest.mark.parametrize("preset", PRESETS)
@SETTINGS
@given(data=st.data(), arch=st.sampled_from(ARCHS), request=requests())
def test_policy_properties(preset, data, arch, request):
    name, params, policy = data.draw(policies(preset), label="policy")
    rows, program = request
    event(f"schedule {policy.schedule.name}"), event(f"batch {len(rows)}")
    event(f"{'ratio' if policy.ratio is not None else 'budget'}, allocator {policy.allocator.name}")
    model = get_model(arch, "kv")
    batched = checked_and_deterministic_run(model, rows, name, params, policy, program)

    # without inspection between forwards (a second turn right after the prompt then continues it)
    free = run_rows(model, rows, name, params, program, inspect=False)
    for logits in free.logits:
        assert bool(torch.isfinite(logits).all())
    check_positions(free, rows)
    if not prompt_continued(rows, program):  # then inspecting changes nothing
        assert free.kept == batched.kept
        assert all(torch.equal(x, y) for x, y in zip(free.logits, batched.logits, strict=True))

    # row independence: each row alone, with and without inspection
    if len(rows) > 1 and not known_row_dependence(policy, [len(r) for r in rows], program):
        for b, row in enumerate(rows):
            for inspect, run in ((True, batched), (False, free)):
                if not inspect and not prompt_continued(rows, program):
                    continue  # the same runs
                alone = run_rows(model, [row], name, params, program, inspect=inspect)
                outcome, why = compare_row(run, alone, b)
                assert outcome != "differs", f"row {b} (length {len(row)}, pad {run.pads[b]}), {inspect=}: {why}"


#: Presets that leave a layer's heads at different lengths (head budgets, a global budget, a head split).
RAGGED_PRESETS = [p for p in ("adakv", "ada_restkv", "dbtrimkv", "kvzip", "duo_attention", "cake") if p in PRESETS]


@pytest.mark.parametrize("preset", RAGGED_PRESETS)
@settings(SETTINGS, max_examples=max(MAX_EXAMPLES // 3, 1))
@given(data=st.data(), arch=st.sampled_from(ARCHS), request=requests())
def test_policy_properties_in_strided_runs(preset, data, arch, request):
    """The invariants above (positions, events, budgets, finite logits, determinism) with uneven heads laid out in
    strided runs wherever a cut exists: one more attention call priced at one slot and no padding cap, so the tiny
    models' short heads take the layout long heads get."""
    from unittest.mock import patch

    from kvsieve.cache import length_groups, store_compaction

    with patch.object(length_groups, "CALL_COST", 1), patch.object(length_groups, "RUN_CALL_COST", 1), \
            patch.object(store_compaction, "MAX_PADDING", 100.0):
        name, params, policy = data.draw(policies(preset), label="policy")
        rows, program = request
        checked_and_deterministic_run(get_model(arch, "kv"), rows, name, params, policy, program)


@pytest.mark.parametrize("preset", PRESETS)
@settings(SETTINGS, max_examples=max(MAX_EXAMPLES // 3, 1))
@given(data=st.data(), arch=st.sampled_from(ARCHS), request=requests())
def test_model_unchanged_after_kvsieve(preset, data, arch, request):
    """The model a kvsieve cache used gives bit-identical DynamicCache outputs to an untouched copy."""
    name, params, _ = data.draw(policies(preset), label="policy")
    rows, program = request
    model = get_model(arch, "kv")
    run_rows(model, rows, name, params, program)
    assert model.config._attn_implementation == "kvsieve"
    for mine, theirs in zip(plain_logits(model, rows, False), plain_logits(get_model(arch, "ref"), rows, False),
                            strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.skipif(not STATIC_CACHE_CHECK, reason="StaticCache property disabled (STATIC_CACHE_CHECK)")
@pytest.mark.parametrize("preset", PRESETS)
@settings(SETTINGS, max_examples=STATIC_EXAMPLES)
@given(data=st.data(), arch=st.sampled_from(ARCHS), request=requests())
def test_model_unchanged_after_kvsieve_static_cache(preset, data, arch, request):
    """Same with a StaticCache: the kvsieve attention must leave transformers' static path untouched."""
    name, params, _ = data.draw(policies(preset), label="policy")
    rows, program = request
    model = get_model(arch, "kv")
    run_rows(model, rows, name, params, program)
    for mine, theirs in zip(plain_logits(model, rows, True), plain_logits(get_model(arch, "ref"), rows, True),
                            strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.xfail(strict=True, reason="engine: a block of one query is taken for a decoding step (buffer applies)")
def test_blockwise_block_of_one_query_is_not_a_decoding_step():
    """Blockwise evicts back to the budget after every block of a prompt, whatever the block size."""
    model = get_model("llama", "kv")
    cache = kvsieve.KVCache(model, "h2o", budget=4, schedule="blockwise", block_size=1, buffer=3)
    with torch.no_grad():
        model(torch.arange(3, 13)[None], **cache_kwargs(model, cache))
    assert int(cache.head_lengths().max()) <= 4  # holds 6: evicted only past budget + buffer
