"""Every-step decoding eviction (issue 22): the drop-one plan, the store's drop-one compaction, and the decoding
output taken from the attention row the scorer reads.

* ``LayerPlans._drop_one`` (one entry over the budget in every head of a uniform store) gives exactly the plan of
  the general path (scores → uniform allocator → ``Action.plan``): on the CPU from each head's minimum, declining a
  tie for the lowest score (top-k's choice stays top-k's); on a GPU from the same top-k as the general path, equal
  scores included, reading nothing back from the device (forced here on the CPU);
* ``LayerStore.drop_one`` leaves the same entries, positions, side data and layout as ``keep`` of the same plan;
* a row compacting at a decoding step takes its output from ``P·V`` of the float32 row its scorer reads: the same
  kept entries and logits within float32 rounding as SDPA's output, on every architecture; a row that does not
  compact at that step keeps SDPA's output bit for bit, whatever its neighbours do.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ALL_ARCHS, build_model
from helpers import all_kept_positions, left_pad, prompt

import kvsieve
from kvsieve.cache.store import LayerStore
from kvsieve.engine.engine import Engine
from kvsieve.engine.layer_plans import LayerPlans
from kvsieve.native import evict_lowest
from kvsieve.transformers_adapter import cache_kwargs

DECODE_STEPS = 6


def _decode(model, policy: str, params: dict, rows: list[torch.Tensor], fused: bool, monkeypatch
            ) -> tuple[list[torch.Tensor], list[list[list[int]]], list[torch.Tensor]]:
    """Prompt (left-padded) then fixed decoding tokens; logits and kept positions after every decoding step, and
    the rows fused at each decision (empty when ``fused`` is False: the decision is overridden to None). Through the
    general step: the in-place pass of a uniform store (``kvsieve.native.evict_lowest``, tested in
    ``test_native_evict_lowest.py``) is off."""
    monkeypatch.setattr(evict_lowest, "available", lambda: False)
    decisions: list[torch.Tensor] = []
    original = Engine._fused_decoding_rows

    def spy(self, call, step):
        rows_fused = original(self, call, step)
        if rows_fused is not None:
            decisions.append(rows_fused.clone())
        return rows_fused if fused else None

    monkeypatch.setattr(Engine, "_fused_decoding_rows", spy)
    ids, mask, _ = left_pad(rows) if len(rows) > 1 else (rows[0][None], None, [0])
    cache = kvsieve.KVCache(model, policy, **params)
    model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    logits, kept = [], []
    tokens = prompt(len(rows), DECODE_STEPS, seed=5)
    for step in range(DECODE_STEPS):
        token = tokens[:, step : step + 1]
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits.append(model(token, attention_mask=mask, **cache_kwargs(model, cache)).logits[:, -1])
        kept.append([positions.tolist() for *_, positions in all_kept_positions(cache)])
    monkeypatch.setattr(Engine, "_fused_decoding_rows", original)
    return logits, kept, decisions


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_fused_decoding_output_equals_sdpa_on_every_architecture(arch, monkeypatch):
    model = build_model(arch)
    rows = [prompt(1, 40, seed=1)[0], prompt(1, 33, seed=2)[0]]
    params = {"budget": 24, "schedule": "decode"}
    fused_logits, fused_kept, decisions = _decode(model, "h2o", params, rows, True, monkeypatch)
    plain_logits, plain_kept, _ = _decode(model, "h2o", params, rows, False, monkeypatch)
    assert decisions and all(bool(d.all()) for d in decisions)  # both rows over the budget: every row fused
    assert fused_kept == plain_kept
    for fused, plain in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("policy", "params"), [("tova", {"budget": 24, "schedule": "decode"}),
                                                ("h2o", {"budget": 24, "schedule": "blockwise", "block_size": 8}),
                                                ("h2o_caote", {"budget": 24, "schedule": "decode"})])
def test_fused_decoding_output_for_row_reading_scorers(policy, params, monkeypatch):
    model = build_model("llama")
    rows = [prompt(1, 40, seed=3)[0], prompt(1, 31, seed=4)[0]]
    fused_logits, fused_kept, decisions = _decode(model, policy, params, rows, True, monkeypatch)
    plain_logits, plain_kept, _ = _decode(model, policy, params, rows, False, monkeypatch)
    assert decisions
    assert fused_kept == plain_kept
    for fused, plain in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_a_row_that_does_not_compact_keeps_sdpa_bit_for_bit(native, monkeypatch):
    """Row 0 (40 tokens) compacts at every step; row 1 (20 tokens) only once it holds more than 24 entries: until
    then its logits are SDPA's, bit for bit the same as with the fusion off — with row 0's output and row from the
    CPU's C pass (``native``; ``kvsieve.native.decoding_rows``) or from PyTorch's float32 products."""
    from kvsieve.native import decoding_rows

    taken: list[bool] = []
    real = decoding_rows.attend

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(decoding_rows, "attend", spy if native else (lambda *args, **kwargs: None))
    model = build_model("llama")
    rows = [prompt(1, 40, seed=6)[0], prompt(1, 20, seed=7)[0]]
    params = {"budget": 24, "schedule": "decode"}
    fused_logits, _, decisions = _decode(model, "h2o", params, rows, True, monkeypatch)
    plain_logits, _, _ = _decode(model, "h2o", params, rows, False, monkeypatch)
    mixed = [d for d in decisions if bool(d[0]) and not bool(d[1])]
    assert mixed and not any(bool(d[1]) and not bool(d[0]) for d in decisions)
    for step in range(4):  # row 1 holds 21..24 entries: it never compacts, in either run
        assert torch.equal(fused_logits[step][1], plain_logits[step][1])
    if native and decoding_rows._kernel() is not None:  # the pass gave row 0's output (it may equal SDPA's here)
        assert taken and all(taken)
    else:
        assert not torch.equal(fused_logits[0][0], plain_logits[0][0])  # row 0's output is the fused one


def test_nothing_is_fused_under_the_prefill_schedule(monkeypatch):
    model = build_model("llama")
    _, _, decisions = _decode(model, "h2o", {"budget": 24}, [prompt(1, 40, seed=8)[0]], True, monkeypatch)
    assert decisions == []


@pytest.mark.parametrize("host_reads", [True, False], ids=["cpu-route", "device-route"])
@pytest.mark.parametrize(("policy", "params"), [
    ("h2o", {"budget": 24, "schedule": "decode"}),
    ("tova", {"budget": 24, "schedule": "decode"}),
    ("random", {"budget": 24, "schedule": "decode"}),
    ("streaming_llm", {"budget": 24, "schedule": "decode"}),
    ("h2o_caote", {"budget": 24, "schedule": "decode"}),
])
def test_drop_one_plan_equals_the_general_plan(policy, params, host_reads, monkeypatch):
    """Every drop-one plan keeps what scores → allocator → ``Action.plan`` keep, and drops the one entry it leaves
    out; the CPU route may decline (a tie), the device route always plans."""
    monkeypatch.setattr("kvsieve.engine.layer_plans.reads_host_cheaply", lambda device: host_reads)
    original = LayerPlans._drop_one
    made = []

    def check(self, layer_idx, step):
        plan = original(self, layer_idx, step)
        if plan is None:
            assert host_reads  # only the CPU route hands a tie to the general path
            return None
        _assert_general_plan(self, layer_idx, step, plan)
        made.append(layer_idx)
        return plan

    monkeypatch.setattr(LayerPlans, "_drop_one", check)
    model = build_model("llama")
    _decode(model, policy, params, [prompt(1, 40, seed=9)[0]], True, monkeypatch)
    assert made  # the fast path ran


def _assert_general_plan(plans: LayerPlans, layer_idx: int, step, plan) -> None:
    lengths, nominal = plans.nominal(layer_idx, step)
    scores = plans.policy.scorer.score(step, nominal)
    general = plans.policy.action.plan(scores, plans.policy.allocator.allocate(scores, nominal, lengths), step)
    assert torch.equal(plan.keep, general.keep) and torch.equal(plan.counts, general.counts)
    remaining = torch.ones(plan.keep.shape[0], plan.keep.shape[1] + 1, dtype=torch.bool)
    remaining.scatter_(1, plan.keep, False)
    assert torch.equal(remaining.float().argmax(dim=1), plan.dropped)  # the one entry not kept


class _HostReads:
    """Records the operations of a block that read a tensor's value back to the host."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        reads: list[str] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "_local_scalar_dense" in str(func) or str(func).startswith("aten.equal"):
                    reads.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode, self.reads = Mode(), reads


@pytest.mark.parametrize("host_reads", [True, False], ids=["cpu-route", "device-route"])
def test_drop_one_with_tied_lowest_scores(host_reads, monkeypatch):
    """Every raw score equal (0). CPU route: one host read finds the tie and the general path decides (top-k's
    choice stays top-k's). Device route: the drop-one path plans — the general path's plan, the same top-k deciding
    between equal scores — and reads nothing back (on a GPU a host read waits for the device at every layer)."""
    monkeypatch.setattr("kvsieve.engine.layer_plans.reads_host_cheaply", lambda device: host_reads)
    original = LayerPlans._drop_one
    outcomes, reads = [], []

    def record(self, layer_idx, step):
        recorder = _HostReads()
        with recorder.mode:
            plan = original(self, layer_idx, step)
        reads.extend(recorder.reads)
        outcomes.append(plan is None)
        if plan is not None:
            _assert_general_plan(self, layer_idx, step, plan)
        return plan

    monkeypatch.setattr(LayerPlans, "_drop_one", record)
    monkeypatch.setattr(evict_lowest, "available", lambda: False)  # the general step's plan, from the patched scores
    monkeypatch.setattr("kvsieve.parts.scorers.h2o.AccumulatedAttention.raw",
                        lambda self, step, nominal: torch.zeros(step.view.positions.shape))
    model = build_model("llama")
    cache = kvsieve.KVCache(model, "h2o", budget=24, schedule="decode")
    model(prompt(1, 40, seed=10), **cache_kwargs(model, cache))
    model(prompt(1, 1, seed=11), **cache_kwargs(model, cache))
    assert outcomes and all(declined == host_reads for declined in outcomes)
    assert (reads != []) == host_reads
    assert int(cache.head_lengths().max()) == 24  # evicted either way


@pytest.mark.parametrize("reserve", [0, 1, 3])
def test_store_drop_one_equals_keep(reserve):
    batch, heads, dim, length = 2, 3, 4, 9
    store = LayerStore(batch, heads, dim, torch.float32, torch.device("cpu"))
    store.ensure_extra("acc")
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(batch, heads, length, dim, generator=generator), torch.randn(
        batch, heads, length, dim, generator=generator)
    store.append(keys, values, 0, None)
    store.add_dense("acc", torch.rand(batch, heads, length, generator=generator))
    assert store.is_uniform
    dropped = torch.tensor([0, 8, 4, 1, 7, 3])
    offsets = torch.arange(length - 1)
    keep = offsets[None, :] + (offsets[None, :] >= dropped[:, None])
    expected = copy.deepcopy(store)
    with store.reserving(reserve):
        store.drop_one(dropped)
    with expected.reserving(reserve):
        expected.keep(keep, torch.full((batch * heads,), length - 1))
    assert store.is_uniform and store.max_length == length - 1
    assert store.keys.shape[0] == expected.keys.shape[0] == batch * heads * (length - 1 + reserve)
    got, want = store.dense(), expected.dense()
    for name in ("keys", "values", "positions"):
        assert torch.equal(getattr(got, name), getattr(want, name))
    assert torch.equal(got.extras["acc"], want.extras["acc"])
    dense_keys = keys.reshape(batch * heads, length, dim)
    assert torch.equal(got.keys.reshape(batch * heads, length - 1, dim)[1], dense_keys[1, :8])  # the newest went
    # later appends land after the kept entries, as after keep
    more = torch.randn(batch, heads, 1, dim, generator=generator)
    store.append(more, more, length, None)
    expected.append(more, more, length, None)
    assert torch.equal(store.dense().keys, expected.dense().keys)
    assert torch.equal(store.dense().positions, expected.dense().positions)
