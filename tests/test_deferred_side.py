"""Deferred side data (``kvsieve.cache.deferred_side``): a decoding step's side data computed later, in a batch.

* A store that defers holds, after any program of decoding appends, prompt appends (padded or not), growth,
  compactions, batch selection, rollback and save/restore, exactly the side data of a store that computed every
  update at once (hypothesis, seeded), and it did defer: values of several steps were computed in one batch.
* ``dbtrimkv`` and ``trimkv`` decode with their gates deferred as they do with the gates computed at every step
  (same logits, kept entries and ``log β``), and the store counts the pending inputs in its bytes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_model
from helpers import prompt, random_gates
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvsieve
import kvsieve.cache.store_append as store_append
from kvsieve.cache.store import LayerStore
from kvsieve.core.step import AppendedUpdate
from kvsieve.engine.engine import Engine
from kvsieve.parts.scorers import retention
from kvsieve.transformers_adapter import cache_kwargs

B, H, D = 2, 3, 4
SIDE = "side"


class Batched:
    """A side-data function of the steps' inputs ``(batch, k, D)`` → ``(batch, H, k)``, exact in float32 (small
    integers), counting how many inputs each call computed at once."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        self.sizes.append(inputs.shape[1])
        return inputs.sum(dim=-1)[:, None, :] * torch.arange(1.0, H + 1)[None, :, None]


def _store() -> LayerStore:
    store = LayerStore(B, H, D, torch.float32, torch.device("cpu"))
    store.ensure_extra(SIDE)
    return store


def _same(deferred: LayerStore, eager: LayerStore) -> None:
    """The same entries and side data (reading the deferring store's side data settles it)."""
    a, b = deferred.dense(), eager.dense()
    assert torch.equal(deferred.lengths(), eager.lengths())
    valid = torch.ones(a.positions.shape, dtype=torch.bool) if a.valid is None else a.valid  # padding: anything
    for name in ("keys", "values", "positions"):
        assert torch.equal(getattr(a, name)[valid], getattr(b, name)[valid])
    assert torch.equal(a.extras[SIDE][valid], b.extras[SIDE][valid])


#: ``step_read``: side data read between a step's append and its deferral (as a decoding step's attention may).
OPERATIONS = ("step", "step", "step", "step_read", "prompt", "keep", "read", "select", "rollback", "save")


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture only sets two constants
@given(data=st.data())
def test_a_deferring_store_holds_what_an_eager_store_holds(data, monkeypatch_growth):
    deferred, eager, compute = _store(), _store(), Batched()
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    position, batch = 0, B

    def append(q: int, padded: bool, read: bool = False) -> None:
        nonlocal position
        keys = torch.randn(batch, H, q, D, generator=generator)
        values = torch.randn(batch, H, q, D, generator=generator)
        valid = None
        if padded:  # the first row left-padded by one token
            valid = torch.ones(batch, q, dtype=torch.bool)
            valid[0, 0] = False
        inputs = torch.randint(-4, 5, (batch, q, D), generator=generator).float()
        for store in (deferred, eager):
            store.append(keys, values, position, valid)
        if read:  # the earlier steps' values settle while this step's entries are already there
            deferred.dense().extras[SIDE]
        if q == 1 and not padded:
            deferred.defer_to_appended(SIDE, inputs, compute)
        else:
            deferred.add_to_appended(SIDE, compute(inputs))
        eager.add_to_appended(SIDE, compute(inputs))
        position += q

    append(data.draw(st.integers(2, 6), label="prompt"), False)
    for op in data.draw(st.lists(st.sampled_from(OPERATIONS), min_size=4, max_size=24), label="program"):
        if op in ("step", "step_read"):
            append(1, False, op == "step_read")
        elif op == "prompt":
            append(data.draw(st.integers(1, 3)), data.draw(st.booleans()))
        elif op == "keep":
            lengths = eager.lengths().reshape(-1)
            counts = torch.tensor([data.draw(st.integers(0, int(n))) for n in lengths.tolist()])
            width = max(1, int(lengths.max()))
            local = torch.stack([torch.cat([torch.randperm(int(n), generator=generator)[: int(c)].sort().values,
                                            torch.zeros(width - int(c), dtype=torch.long)])
                                 for n, c in zip(lengths.tolist(), counts.tolist(), strict=True)])
            for store in (deferred, eager):
                store.keep(local, counts)
        elif op == "read":
            _same(deferred, eager)
        elif op == "select":
            index = torch.tensor(data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=3)))
            for store in (deferred, eager):
                store.select_batch(index)
            batch = len(index)
        elif op == "rollback":
            limit = data.draw(st.integers(0, position))
            for store in (deferred, eager):
                store.keep_positions_before(limit)
            position = limit
        else:  # saved and restored (a saved context): the pending values are part of what is saved
            saved = deferred.entries()
            deferred = LayerStore(batch, H, D, torch.float32, torch.device("cpu"))
            deferred.ensure_extra(SIDE)
            deferred.restore(saved)
            assert all(torch.equal(saved[name], value) for name, value in eager.entries().items())
    _same(deferred, eager)


def test_the_store_defers_and_counts_what_it_holds_pending():
    """Steps' values are computed on the first read, not at their steps (each step's input on its own, so the values
    are a per-step computation's bit for bit); the pending inputs count in the bytes; an append that is not one entry
    per segment settles first."""
    store, compute = _store(), Batched()
    store.append(*torch.randn(2, B, H, 3, D).unbind(0), 0, None)
    base = store.nbytes()
    for step in range(5):
        store.append(*torch.randn(2, B, H, 1, D).unbind(0), 3 + step, None)
        store.defer_to_appended(SIDE, torch.ones(B, 1, D) * step, compute)
    assert compute.sizes == []
    assert store.deferred_nbytes() == 5 * B * D * 4
    pending, store._deferred = store._deferred, {}
    without = store.nbytes()
    store._deferred = pending
    assert store.nbytes() == without + 5 * B * D * 4 and without >= base
    assert store.side_names() == (SIDE,) and compute.sizes == []  # naming the fields computes nothing
    side = store.dense().extras[SIDE]
    assert compute.sizes == [1] * 5
    expected = torch.arange(5.0)[None, None, :] * D * torch.arange(1.0, H + 1)[None, :, None]
    assert torch.equal(side[:, :, 3:], expected.expand(B, H, 5))
    assert torch.equal(side[:, :, :3], torch.zeros(B, H, 3)) and store.deferred_nbytes() == 0
    store.append(*torch.randn(2, B, H, 1, D).unbind(0), 8, None)
    store.defer_to_appended(SIDE, torch.ones(B, 1, D), compute)
    store.append(*torch.randn(2, B, H, 2, D).unbind(0), 9, None)  # a prompt's two entries: the step's value first
    assert compute.sizes == [1] * 6
    assert torch.equal(store.dense().extras[SIDE][:, :, 8], (float(D) * torch.arange(1.0, H + 1)).expand(B, H))


@pytest.fixture
def monkeypatch_growth(monkeypatch):
    """Small growth steps and row tables, so a few appends grow the buffers and rebuild the tables."""
    monkeypatch.setattr(store_append, "GROWTH", 3)
    monkeypatch.setattr(store_append, "ROW_TABLE_STEPS", 3)


def _eager_observe(monkeypatch) -> None:
    """Every step's gates computed at once (what the scorer did before deferring), every step the general one (the
    plain step defers)."""
    def observe(self, step):
        gate = retention.LayerGate(self._gates(), step.layer_idx, step.kv_heads)
        return {retention.LOG_BETA: AppendedUpdate(gate(step.inputs()))}

    monkeypatch.setattr(retention.RetentionGate, "observe", observe)
    monkeypatch.setattr(Engine, "_plain_decoding_step", lambda self, *args: None)


@pytest.mark.parametrize(("policy", "params"), [
    ("dbtrimkv", {"budget": 10, "window": 1}),
    ("trimkv", {"budget": 10, "window": 1}),
    ("dbtrimkv", {"budget": 10, "window": 1, "buffer": 0}),
])
def test_gates_deferred_decode_as_gates_computed_at_every_step(policy, params, monkeypatch):
    model = build_model("llama")
    gates = random_gates(model, tied=policy == "dbtrimkv")
    ids = prompt(batch=2, length=30, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    batch_calls: list[int] = []
    original = retention.LayerGate.__call__

    def counted(self, inputs):
        batch_calls.append(inputs.shape[1])
        return original(self, inputs)

    runs = {}
    step_calls: dict[str, list[int]] = {"deferred": [], "eager": []}  # the gates' calls per decoding step
    for mode in ("deferred", "eager"):
        with monkeypatch.context() as patch:
            if mode == "eager":
                _eager_observe(patch)
            patch.setattr(retention.LayerGate, "__call__", counted)
            cache = kvsieve.KVCache(model, policy, gates=gates, **params)
            logits, attention = [], mask
            out = model(ids, attention_mask=attention, **cache_kwargs(model, cache))
            token = out.logits[:, -1:].argmax(-1)
            for step in range(24):
                attention = torch.cat([attention, torch.ones_like(token)], dim=1)
                before = len(batch_calls)
                out = model(token, attention_mask=attention, **cache_kwargs(model, cache))
                step_calls[mode].append(len(batch_calls) - before)
                logits.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
                if step == 11:
                    saved = copy.deepcopy(cache)  # a copy carries the pending inputs with it
            runs[mode] = (cache, logits, saved)
    layers = model.config.num_hidden_layers
    assert step_calls["eager"] == [layers] * 24
    if params.get("buffer") == 0:  # a plan at every step: every step's gates computed at it
        assert step_calls["deferred"] == step_calls["eager"]
    else:  # no gate computed at most steps, several steps' at a layer's plan
        assert min(step_calls["deferred"]) == 0 and max(step_calls["deferred"]) > layers
    (deferred, got, copied), (eager, want, copied_eager) = runs["deferred"], runs["eager"]
    for a, b in zip(got, want, strict=True):  # each step's gates computed alone, as the eager step does: the same bits
        assert torch.equal(a, b)
    heads = model.config.num_key_value_heads
    for first, second in ((deferred, eager), (copied, copied_eager)):
        assert torch.equal(first.head_lengths(), second.head_lengths())
        for layer in range(layers):
            for row in range(2):
                for head in range(heads):
                    assert torch.equal(first.kept_positions(layer, row, head), second.kept_positions(layer, row, head))
            a = first.engine.layers[layer].store.dense()
            b = second.engine.layers[layer].store.dense()
            valid = torch.ones(a.positions.shape, dtype=torch.bool) if a.valid is None else a.valid
            assert torch.equal(a.extras[retention.LOG_BETA][valid], b.extras[retention.LOG_BETA][valid])
