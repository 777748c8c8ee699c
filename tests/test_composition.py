"""Any composition of parts works or is refused at construction: every scorer × selector × action.

"Any combination works" is the promise of a policy as parts. A combination that cannot run must say so
when the ``Policy`` is built (``PolicyConfigError`` naming the parts), never at the first decoding step
(``Policy(scorer=snapkv, selector=hsa_mt)`` used to raise ``KeyError: 'stage1_keep'`` there).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import build_model
from helpers import prompt, random_pattern
from test_row_independence import CharTokenizer

import kvsieve
from kvsieve import PolicyConfigError
from kvsieve.gates.retention import GateConfig, RetentionGates
from kvsieve.generation.reconstruction import reads_reconstruction
from kvsieve.parts.scorers.caote import Caote
from kvsieve.parts.scorers.duo_attention import HeadSplit
from kvsieve.parts.scorers.retention import RetentionGate
from kvsieve.parts.scorers.snapkv import WindowAttention
from kvsieve.policies.catalog import parts

BUDGET, PROMPT, STEPS = 24, 48, 3


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def _builtin(kind: str) -> dict:
    """kvsieve's own parts (tests register parts of their own)."""
    return {n: c for n, c in parts(kind).items() if c.__module__.startswith("kvsieve.")}


ACTIONS, SCORERS, SELECTORS = _builtin("action"), _builtin("scorer"), _builtin("selector")


def _scorer(name: str, model):
    if SCORERS[name] is RetentionGate:
        return RetentionGate(gates=RetentionGates(GateConfig.for_model(model), seed=0), window=4)
    cls = SCORERS[name]
    if cls is HeadSplit:  # no shipped head pattern for a random model
        return HeadSplit(pattern=random_pattern(model), sinks=2)
    if cls is Caote:  # a correction over a base scorer
        return Caote(base=WindowAttention(window=4))
    return cls(window=4) if "window" in cls.__dataclass_fields__ else cls()


COMBINATIONS = list(itertools.product(sorted(SCORERS), [None, *sorted(SELECTORS)], sorted(ACTIONS)))


@pytest.mark.parametrize(("scorer", "selector", "action"), COMBINATIONS)
def test_every_composition_runs_or_is_refused_at_construction(scorer, selector, action, model):
    try:
        policy = kvsieve.Policy(
            scorer=_scorer(scorer, model), selector=None if selector is None else SELECTORS[selector](k=8),
            action=ACTIONS[action](), budget=BUDGET,
        )
        cache = kvsieve.KVCache(model, policy)
    except PolicyConfigError as err:
        assert str(err)  # refused up front, with a reason
        return
    ids = prompt(length=PROMPT, seed=11)
    if reads_reconstruction(cache):  # KVzip: the prompt but its last token, reconstructed, then generate
        with torch.no_grad():
            model(ids[:, :-1], **kvsieve.cache_kwargs(model, cache))
        kvsieve.reconstruct(model, CharTokenizer(), cache, ids[:, :-1])
    out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, **kvsieve.cache_kwargs(model, cache))
    assert out.shape == (1, PROMPT + STEPS)
    assert torch.isfinite(model(out[:, -1:], **kvsieve.cache_kwargs(model, cache)).logits).all()
    held = cache.head_lengths()
    if isinstance(cache.policy.scorer, HeadSplit):  # DuoAttention: retrieval heads hold everything
        bound = cache.policy.scorer
        streaming = torch.stack([bound.streaming_heads(i, held.shape[2], held.device) for i in range(3)])
        if policy.action.quantizes:  # the budget bounds a streaming head's full-precision part
            held = torch.stack([layer.store.full_lengths() for layer in cache.layers])
        if policy.evicts or policy.action.quantizes:
            assert int(held[:, 0][streaming].max()) <= BUDGET + STEPS + 1
        assert int(held.max()) <= PROMPT + STEPS + 1
    elif policy.action.quantizes:  # KIVI regime: nothing evicted, the budget is the full-precision part
        full = torch.stack([layer.store.full_lengths() for layer in cache.layers])
        assert int(full.max()) <= BUDGET + STEPS + 1 and int(held.max()) <= PROMPT + STEPS + 1
    elif policy.evicts:
        assert int(held.max()) <= BUDGET + STEPS + 1  # the prompt's compaction, then one entry per step
    assert cache.get_seq_length() == PROMPT + STEPS  # generate feeds all but its last token; one more step
