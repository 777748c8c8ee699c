"""Both cache keywords, on every transformers version the matrix runs.

transformers 5.24 renamed the cache keyword of models and ``generate`` from ``past_key_values=`` to
``cache=`` (the old name still works, deprecated). kvsieve's own calls use the installed spelling
(:func:`kvsieve.transformers_adapter.cache_kwargs`); a user may pass either. Each test drives a kvsieve
cache under one keyword and checks it against the installed spelling (or against plain transformers):
forwards, the layer-input hooks (learned scorers), ``prefill_shared``, ``compress_context`` and
``generate``. ``cache=`` is skipped where the installed transformers does not have it (before 5.24).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from conftest import build_model
from helpers import prompt, random_gates
from transformers import DynamicCache

import kvsieve
from kvsieve.models.tiny import load_tiny_llama
from kvsieve.transformers_adapter import CACHE_KEYWORDS, cache_keyword, cache_kwargs, output_cache

pytestmark = pytest.mark.compat

KEYWORDS = ("past_key_values", "cache")


@contextmanager
def _allow_deprecated_keyword() -> Iterator[None]:
    """transformers' own deprecation of ``past_key_values=`` (from 5.24) is not what these tests check."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*past_key_values.*", FutureWarning)
        yield


def _spelled(model: torch.nn.Module, keyword: str, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}``; skips ``cache=`` where the installed transformers does not take it
    (``past_key_values=`` is taken everywhere: a parameter up to 5.23, a deprecated alias from 5.24)."""
    if keyword != "past_key_values" and keyword not in inspect.signature(type(model).forward).parameters:
        pytest.skip(f"transformers {kvsieve.transformers_adapter.VERSION} has no {keyword}= keyword")
    return {keyword: cache}


def _decode(model: torch.nn.Module, cache: Any, ids: torch.Tensor, keyword: str | None, steps: int = 3) -> list:
    """Prefill ``ids`` then ``steps`` greedy steps by hand; ``keyword`` None: the installed spelling."""
    logits = []
    step_ids = ids
    with _allow_deprecated_keyword():
        for _ in range(steps + 1):
            kwargs = cache_kwargs(model, cache) if keyword is None else _spelled(model, keyword, cache)
            out = model(input_ids=step_ids, use_cache=True, **kwargs)
            assert output_cache(out) is cache
            logits.append(out.logits[:, -1])
            step_ids = out.logits[:, -1:].argmax(-1)
    return logits


def _assert_same_cache(a: kvsieve.KVCache, b: kvsieve.KVCache) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    assert torch.equal(a.head_lengths(), b.head_lengths())
    for layer in range(len(a.layers)):
        for batch in range(a.head_lengths().shape[1]):
            assert torch.equal(a.kept_positions(layer, batch, 1), b.kept_positions(layer, batch, 1))


def test_installed_keyword_is_the_models_own():
    model = build_model("llama")
    keyword = cache_keyword(model)
    assert keyword in CACHE_KEYWORDS
    assert keyword in inspect.signature(type(model).forward).parameters
    assert keyword in inspect.signature(type(model.model).forward).parameters
    assert list(cache_kwargs(model, None)) == [keyword]


@pytest.mark.parametrize("keyword", KEYWORDS)
@pytest.mark.parametrize("policy", ["full", "snapkv", "h2o"])
def test_forward_under_either_keyword(keyword: str, policy: str):
    model = build_model("llama")
    ids = prompt(batch=2, length=20, seed=1)
    params = {"full": {}, "snapkv": {"budget": 8, "window": 4}, "h2o": {"budget": 8}}[policy]
    theirs = kvsieve.KVCache(model, policy, **params)
    ours = kvsieve.KVCache(model, policy, **params)
    for a, b in zip(_decode(model, theirs, ids, keyword), _decode(model, ours, ids, None), strict=True):
        assert torch.equal(a, b)
    _assert_same_cache(theirs, ours)
    if policy == "full":  # and plain transformers agrees
        ref = build_model("llama")
        for a, b in zip(_decode(model, kvsieve.KVCache(model, "full"), ids, keyword),
                        _decode(ref, DynamicCache(config=ref.config), ids, None), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("keyword", KEYWORDS)
@pytest.mark.parametrize("policy", ["trimkv", "dbtrimkv"])
def test_layer_input_hooks_find_the_cache_under_either_keyword(keyword: str, policy: str):
    """Learned gates read each layer's attention input through a forward pre-hook that finds the cache
    in the attention module's keyword arguments, under whichever name transformers passes it."""
    model = build_model("llama")
    gates = random_gates(model, tied=policy == "dbtrimkv", seed=2)
    ids = prompt(batch=2, length=24, seed=3)
    theirs = kvsieve.KVCache(model, policy, budget=6, window=1, gates=gates)
    received: list[int] = []
    receive = theirs.receive_layer_inputs

    def counted(layer_idx: int | None, hidden: torch.Tensor) -> None:
        received.append(layer_idx)
        receive(layer_idx, hidden)

    theirs.receive_layer_inputs = counted  # the hook looks the method up on the cache it finds
    ours = kvsieve.KVCache(model, policy, budget=6, window=1, gates=gates)
    steps = 2
    for a, b in zip(_decode(model, theirs, ids, keyword, steps), _decode(model, ours, ids, None, steps), strict=True):
        assert torch.equal(a, b)
    assert received == list(range(model.config.num_hidden_layers)) * (steps + 1)
    _assert_same_cache(theirs, ours)


@pytest.mark.parametrize("keyword", KEYWORDS)
def test_prefill_shared_then_decoding_under_either_keyword(keyword: str):
    model = build_model("llama")
    gates = random_gates(model, seed=4)
    ids = prompt(batch=2, length=30, seed=5)

    def caches() -> list[kvsieve.KVCache]:
        return [kvsieve.KVCache(model, "full"), kvsieve.KVCache(model, "snapkv", budget=8, window=4),
                kvsieve.KVCache(model, "dbtrimkv", budget=6, window=1, gates=gates)]

    shared = caches()
    out = kvsieve.prefill_shared(model, ids, shared)
    for cache, alone in zip(shared, caches(), strict=True):
        own = model(input_ids=ids, use_cache=True, **cache_kwargs(model, alone))
        assert torch.equal(out.logits, own.logits)
        first = own.logits[:, -1:].argmax(-1)
        # Continue both by hand, the shared one under the keyword under test.
        for a, b in zip(_decode(model, cache, first, keyword, 2), _decode(model, alone, first, None, 2), strict=True):
            assert torch.equal(a, b)
        _assert_same_cache(cache, alone)


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return load_tiny_llama()


@pytest.mark.parametrize("keyword", KEYWORDS)
def test_compress_context_then_continuing_under_either_keyword(tiny, keyword: str):
    model, tokenizer = tiny
    context = " ".join(f"Item {i} is stored in box {(7 * i) % 31}." for i in range(40))
    ctx = kvsieve.compress_context(model, tokenizer, context, "snapkv", budget=32, chat=False)
    answer = ctx.ask("Which box holds item 12?", max_new_tokens=3)
    question = torch.tensor([ctx._question_ids("Which box holds item 12?")])
    seen = ctx.stats.context_tokens
    positions = torch.arange(seen, seen + question.shape[1])[None]
    mask = torch.ones((1, seen + question.shape[1]), dtype=torch.long)
    with _allow_deprecated_keyword():
        logits = model(input_ids=question, attention_mask=mask, position_ids=positions, use_cache=True,
                       **_spelled(model, keyword, copy.deepcopy(ctx.cache))).logits[:, -1]
    same = model(input_ids=question, attention_mask=mask, position_ids=positions, use_cache=True,
                 **cache_kwargs(model, copy.deepcopy(ctx.cache))).logits[:, -1]
    assert torch.equal(logits, same)
    assert int(logits.argmax(-1)) == answer.token_ids[0]


@pytest.mark.parametrize("keyword", KEYWORDS)
@pytest.mark.parametrize("policy", ["full", "snapkv", "streaming_llm", "dbtrimkv"])
def test_generate_under_either_keyword(keyword: str, policy: str):
    model, ref = build_model("llama"), build_model("llama")
    ids = prompt(batch=2, length=20, seed=6)
    params: dict[str, Any] = {"full": {}, "snapkv": {"budget": 8, "window": 4}, "streaming_llm": {"budget": 8},
                              "dbtrimkv": {"budget": 8, "window": 1, "gates": random_gates(model, seed=7)}}[policy]

    def run(m: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
        with _allow_deprecated_keyword():
            return m.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **kwargs)

    theirs = run(model, _spelled(model, keyword, kvsieve.KVCache(model, policy, **params)))
    ours = run(model, cache_kwargs(model, kvsieve.KVCache(model, policy, **params)))
    assert torch.equal(theirs.sequences, ours.sequences)
    for a, b in zip(theirs.logits, ours.logits, strict=True):
        assert torch.equal(a, b)
    if policy == "full":  # and plain transformers agrees
        plain = run(ref, cache_kwargs(ref, DynamicCache(config=ref.config)))
        assert torch.equal(theirs.sequences, plain.sequences)
