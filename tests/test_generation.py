"""Compress once, ask many: each question starts from the same compressed context, alone or in a batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kvsieve
from kvsieve.generation import compress_context
from kvsieve.models.tiny import load_tiny_llama

CONTEXT = " ".join(f"Item {i} is stored in box {(7 * i) % 31}." for i in range(60))
QUESTIONS = ["Which box holds item 12?", "Where is item 3 kept, and why?", "Name a box."]


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[Any, Any]]:
    yield load_tiny_llama()


class ForwardCounter:
    """Counts the model's forward calls by input length (wraps the instance's ``forward``)."""

    def __init__(self, model: Any) -> None:
        self.lengths: list[int] = []
        self._model, self._forward = model, model.forward

        def counted(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.lengths.append(int(ids.shape[1]))
            return self._forward(*args, **kwargs)

        model.forward = counted

    def restore(self) -> None:
        del self._model.forward


def _same(a: Any, b: Any) -> None:
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize("policy", ["snapkv", "streaming_llm", "full"])
def test_answers_do_not_depend_on_order_or_batch_and_context_is_compressed_once(tiny, policy: str) -> None:
    model, tokenizer = tiny
    counter = ForwardCounter(model)
    try:
        ctx = compress_context(model, tokenizer, CONTEXT, policy, budget=48, chat=False)
        held = ctx.cache.head_lengths().clone() if policy != "full" else None
        seen = ctx.cache.get_seq_length()
        first = [ctx.ask(q, max_new_tokens=5) for q in QUESTIONS]
        reverse = [ctx.ask(q, max_new_tokens=5) for q in reversed(QUESTIONS)][::-1]
        batch = ctx.ask_batch(QUESTIONS, max_new_tokens=5)
    finally:
        counter.restore()
    context_tokens = ctx.stats.context_tokens
    assert counter.lengths.count(context_tokens) == 1 and counter.lengths[0] == context_tokens  # compressed once
    for a, b, c in zip(first, reverse, batch, strict=True):
        _same(a, b)
        _same(a, c)
    assert len({tuple(a.logprobs) for a in first}) == len(QUESTIONS)  # the questions really differ
    assert ctx.cache.get_seq_length() == seen  # no question's tokens reached the stored context
    if held is not None:
        assert torch.equal(ctx.cache.head_lengths(), held)


def test_stats_count_what_the_cache_holds(tiny) -> None:
    model, tokenizer = tiny
    full = compress_context(model, tokenizer, CONTEXT, "full", chat=False).stats
    snap = compress_context(model, tokenizer, CONTEXT, "snapkv", budget=48, chat=False).stats
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert full.entries_held == full.entries_full == full.context_tokens * layers * kv_heads
    assert full.kv_bytes == full.kv_bytes_full and full.kv_fraction == 1.0
    assert snap.entries_held == 48 * layers * kv_heads and snap.entries_full == full.entries_full
    assert snap.kv_bytes == full.kv_bytes * 48 // full.context_tokens


def test_bad_input_is_refused_before_any_forward(tiny) -> None:
    model, tokenizer = tiny
    counter = ForwardCounter(model)
    try:
        with pytest.raises(ValueError, match="unknown policy"):
            compress_context(model, tokenizer, CONTEXT, "no_such_policy", budget=48)
        with pytest.raises(ValueError, match="context"):
            compress_context(model, tokenizer, "  ", "snapkv", budget=48)
        assert counter.lengths == []
        ctx = compress_context(model, tokenizer, CONTEXT, "snapkv", budget=48, chat=False)
        with pytest.raises(ValueError, match="question"):
            ctx.ask("")
        with pytest.raises(ValueError, match="max_new_tokens"):
            ctx.ask("Why?", max_new_tokens=0)
        with pytest.raises(ValueError, match="questions"):
            ctx.ask_batch("Why?")
    finally:
        counter.restore()
    assert counter.lengths == [ctx.stats.context_tokens]


def test_policy_objects_and_chat_template(tiny) -> None:
    model, tokenizer = tiny
    policy = kvsieve.make_policy("snapkv", budget=40)
    ctx = compress_context(model, tokenizer, CONTEXT, policy)
    assert ctx.format.chat == bool(tokenizer.chat_template)
    assert ctx.stats.entries_held == 40 * model.config.num_hidden_layers * model.config.num_key_value_heads
    assert ctx.ask("Which box holds item 12?", max_new_tokens=2).token_ids


#: A question far longer than "Box?": in a batch, the short one is padded after the shared context.
LONG_QUESTION = ("Please list, one after the other, every item that is stored in box 7, then every item stored in "
                 "box 8, then every item stored in box 9, and explain how you found them")


def _batch_answers_as_alone(ctx: Any, questions: list[str], max_new_tokens: int) -> None:
    alone = [ctx.ask(q, max_new_tokens=max_new_tokens) for q in questions]
    batch = ctx.ask_batch(questions, max_new_tokens=max_new_tokens)
    for a, b in zip(alone, batch, strict=True):
        _same(a, b)


@pytest.mark.parametrize("policy", ["trimkv", "dbtrimkv"])
def test_learned_retention_answers_the_same_alone_and_in_a_batch(tiny, policy: str) -> None:
    """Retention ages counted the padding slots between the context and a shorter question in a batch, so
    ``ask_batch`` differed from ``ask`` by 0.003–0.013 in log-probability; ages now count real tokens."""
    from kvsieve.gates.retention import GateConfig, RetentionGates

    model, tokenizer = tiny
    gates = RetentionGates(GateConfig.for_model(model, tied=policy == "dbtrimkv"), init_std=0.5, seed=3)
    with torch.no_grad():
        gates.b_out.fill_(2.0)  # β well below 1: ages matter
    ctx = compress_context(model, tokenizer, CONTEXT, policy, budget=48, chat=False, gates=gates, window=4,
                           schedule="decode")
    _batch_answers_as_alone(ctx, ["Box?", f"{LONG_QUESTION}."], max_new_tokens=6)


@pytest.mark.parametrize("policy", ["quest", "sparq", "hsa"])
def test_sparse_selectors_answer_the_same_alone_and_in_a_batch(tiny, policy: str) -> None:
    """Page size, ``r`` and ``k1`` came from the longest row of the batch (one configuration per store):
    quest's ``ask_batch`` differed from ``ask`` by 0.048 in log-probability here; each row now gets its own."""
    model, tokenizer = tiny
    ctx = compress_context(model, tokenizer, CONTEXT, policy, budget=64, chat=False)
    _batch_answers_as_alone(ctx, ["Box?", f"{LONG_QUESTION} in the list."], max_new_tokens=24)
