"""A new method is one file: a scorer defined here, with its preset, is used by name like a built-in.

The scorer is the key-norm heuristic (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy
for KV Cache Compression", arXiv:2406.11430): keys with a *low* L2 norm draw attention, so each head keeps
the entries with the smallest key norms (plus a protected recent window). Nothing in kvsieve names it:
the class registers itself, the preset is registered here, and ``KVCache``, ``make_policy``, composition
with other parts and ``kvsieve list`` find both.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import build_model
from helpers import prompt
from transformers import DynamicCache

import kvsieve
from kvsieve.cli import main
from kvsieve.core.part import require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.parts.scorers.base import Scorer
from kvsieve.policies.catalog import parts
from kvsieve.transformers_adapter import cache_kwargs

BUDGET, WINDOW, LENGTH = 10, 2, 24


@dataclass(frozen=True)
class KeyNorm(Scorer):
    """Smallest key L2 norm first (Devoto et al., 2024, arXiv:2406.11430), the newest ``window`` kept."""

    name: ClassVar[str] = "test_key_norm"
    window: int = 0

    def validate(self) -> None:
        require_int(self.name, "window", self.window, 0)

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return -step.view.keys.float().norm(dim=-1)


PRESET = Preset("test_knorm", "keys with the smallest L2 norm (Devoto et al. 2024)", scorer=KeyNorm())


@pytest.fixture
def knorm():
    kvsieve.register_preset(PRESET)
    yield PRESET
    kvsieve.unregister_preset(PRESET.name)


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def test_the_part_registers_itself():
    assert parts("scorer")["test_key_norm"] is KeyNorm


def test_the_preset_is_used_by_name_and_keeps_the_smallest_key_norms(knorm, model):
    ids = prompt(length=LENGTH)
    cache = kvsieve.KVCache(model, "test_knorm", budget=BUDGET, window=WINDOW)
    assert cache.policy.scorer == KeyNorm(window=WINDOW)
    model(ids, **cache_kwargs(model, cache))
    reference = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(model, reference))
    for layer in cache.info.managed_layers:
        keys = reference.layers[layer].keys[0]  # (kv_heads, L, d), as stored (after RoPE)
        for head in range(keys.shape[0]):
            norms = keys[head, : LENGTH - WINDOW].float().norm(dim=-1)
            chosen = torch.topk(-norms, BUDGET - WINDOW).indices
            expected = torch.cat([chosen.sort().values, torch.arange(LENGTH - WINDOW, LENGTH)])
            kept = cache.kept_positions(layer, 0, head)
            assert torch.equal(kept.cpu(), expected), (layer, head)
            assert torch.equal(cache.kept_entries(layer, 0, head)[0], keys[head, expected])


def test_it_composes_with_other_parts_by_name(knorm, model):
    ids = prompt(length=LENGTH)
    as_scorer = kvsieve.KVCache(model, "snapkv", scorer="test_key_norm", budget=BUDGET)
    assert isinstance(as_scorer.policy.scorer, KeyNorm)
    adaptive = kvsieve.KVCache(model, "test_knorm", budget=BUDGET, allocator="adaptive", schedule="blockwise",
                               block_size=8)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, **cache_kwargs(model, adaptive))
    assert out.shape[1] == LENGTH + 3
    held = adaptive.head_lengths()[list(adaptive.info.managed_layers)]  # (layers, batch, kv_heads), ragged
    assert int(held.sum(-1).max()) <= BUDGET * held.shape[-1]  # the adaptive split keeps the layer's total


def test_parameters_route_to_the_field_that_declares_them(knorm):
    assert kvsieve.make_policy("test_knorm", budget=8, window=3).scorer == KeyNorm(window=3)
    with pytest.raises(kvsieve.PolicyConfigError, match="window"):
        kvsieve.make_policy("test_knorm", budget=8, window=-1)
    with pytest.raises(kvsieve.PolicyConfigError, match=r"unexpected parameter 'kernel_size'.*window"):
        kvsieve.make_policy("test_knorm", budget=8, kernel_size=5)


def test_kvsieve_list_shows_it(knorm):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["list"]) == 0
    assert "test_knorm" in out.getvalue() and "test_key_norm" in out.getvalue()


def test_unregistered_presets_are_gone_and_builtins_stay(knorm):
    kvsieve.unregister_preset("test_knorm")
    with pytest.raises(kvsieve.UnknownPolicyError):
        kvsieve.make_policy("test_knorm", budget=8)
    with pytest.raises(kvsieve.PolicyConfigError, match="built-in"):
        kvsieve.unregister_preset("snapkv")
    kvsieve.register_preset(PRESET)  # the fixture removes it again


def test_a_taken_name_is_refused():
    with pytest.raises(TypeError, match="taken"):

        @dataclass(frozen=True)
        class Impostor(Scorer):
            name: ClassVar[str] = "snapkv"
