"""Compress once, keep for later: a compressed context saved to disk answers like the one that was saved,
in this process and in another one; another model or dtype is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvsieve
from kvsieve.models.tiny import load_tiny_llama

CONTEXT = " ".join(f"Item {i} is stored in box {(7 * i) % 31}." for i in range(60))
QUESTIONS = ["Which box holds item 12?", "Name a box."]
POLICIES = [
    ("snapkv", {"window": 8}), ("h2o", {"schedule": "decode"}), ("restkv", {"window": 8}),
    ("ada_restkv", {"window": 8}), ("quest", {}), ("rocketkv_mt", {}), ("ems", {}), ("full", {}),
    # selectors over quantized tiers: pages and sums rebuilt from the restored combined view
    ("rocketkv", {"window": 8, "action": "quantize", "bits": 4, "low_share": 0.5, "group": 8}),
    ("mixed", {"window": 8, "selector": "sparq", "group": 8}),
]


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[Any, Any]]:
    yield load_tiny_llama()


def _answers(ctx: kvsieve.CompressedContext) -> list[tuple[list[int], list[float]]]:
    return [(a.token_ids, a.logprobs) for a in [ctx.ask(q, max_new_tokens=6) for q in QUESTIONS]]


@pytest.mark.parametrize(("policy", "params"), POLICIES)
def test_a_loaded_context_answers_as_the_saved_one(tiny, tmp_path: Path, policy: str, params: dict) -> None:
    model, tokenizer = tiny
    ctx = kvsieve.compress_context(model, tokenizer, CONTEXT, policy, budget=48, **params)
    before = _answers(ctx)
    weights, meta = ctx.save(tmp_path / "ctx")
    loaded = kvsieve.load_context(tmp_path / "ctx", model, tokenizer)
    assert loaded.stats == ctx.stats and _answers(loaded) == before
    if policy != "full":
        assert torch.equal(loaded.cache.head_lengths(), ctx.cache.head_lengths())
        for layer in range(model.config.num_hidden_layers):
            for head in range(model.config.num_key_value_heads):
                ours, theirs = loaded.cache.kept_entries(layer, 0, head), ctx.cache.kept_entries(layer, 0, head)
                assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        if ctx.cache.policy.evicts:  # holds what the cache holds, no more
            assert weights.stat().st_size < 0.6 * ctx.stats.kv_bytes_full
    assert json.loads(meta.read_text())["policy"]["name"] == policy


def test_another_process_answers_the_same(tiny, tmp_path: Path) -> None:
    model, tokenizer = tiny
    ctx = kvsieve.compress_context(model, tokenizer, CONTEXT, "snapkv", budget=48, window=8)
    ctx.save(tmp_path / "ctx")
    expected = _answers(ctx)
    script = textwrap.dedent(f"""
        import json, kvsieve, torch
        from kvsieve.models.tiny import load_tiny_llama
        torch.set_num_threads(1)
        model, tokenizer = load_tiny_llama()
        ctx = kvsieve.load_context({str(tmp_path / "ctx")!r}, model, tokenizer)
        print(json.dumps([(a.token_ids, a.logprobs) for a in [ctx.ask(q, max_new_tokens=6) for q in {QUESTIONS!r}]]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(ids, lp) for ids, lp in got] == [(list(i), list(lp)) for i, lp in expected]


def test_another_model_or_dtype_is_refused(tiny, tmp_path: Path) -> None:
    model, tokenizer = tiny
    kvsieve.compress_context(model, tokenizer, CONTEXT, "snapkv", budget=48, window=8).save(tmp_path / "ctx")
    other, _ = load_tiny_llama()
    with torch.no_grad():
        next(other.parameters()).add_(0.5)
    with pytest.raises(kvsieve.SavedContextError, match="fingerprint"):
        kvsieve.load_context(tmp_path / "ctx", other, tokenizer)
    half, _ = load_tiny_llama(torch.bfloat16)
    with pytest.raises(kvsieve.SavedContextError, match="bfloat16"):
        kvsieve.load_context(tmp_path / "ctx", half, tokenizer)
    weights = tmp_path / "ctx.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(kvsieve.SavedContextError, match="not a readable safetensors"):
        kvsieve.load_context(tmp_path / "ctx", model, tokenizer)


def test_a_policy_object_context_says_how_to_save(tiny, tmp_path: Path) -> None:
    model, tokenizer = tiny
    policy = kvsieve.make_policy("snapkv", budget=48, window=8)
    ctx = kvsieve.compress_context(model, tokenizer, CONTEXT, policy)
    with pytest.raises(kvsieve.SavedContextError, match="preset name"):
        ctx.save(tmp_path / "ctx")
    assert not (tmp_path / "ctx.json").exists()


@pytest.mark.parametrize("policy", ["kivi", "mixed"])
def test_quantized_contexts_answer_many_questions_and_save_as_held(tiny, tmp_path: Path, policy: str) -> None:
    """A context with quantized entries answers every question from the same state, and a saved copy holds the
    tiers packed (no more bytes than the cache's own) and answers exactly as the saved one."""
    model, tokenizer = tiny
    ctx = kvsieve.compress_context(model, tokenizer, CONTEXT, policy, budget=48, group=8, value_group=16)
    first = _answers(ctx)
    assert _answers(ctx) == first  # each question starts from the same compressed context
    assert ctx.cache.layers[0].store.tiered
    weights, _ = ctx.save(tmp_path / "ctx")
    loaded = kvsieve.load_context(tmp_path / "ctx", model, tokenizer)
    assert _answers(loaded) == first
    assert torch.equal(loaded.cache.head_lengths(), ctx.cache.head_lengths())
    assert loaded.cache.kv_nbytes() == ctx.cache.kv_nbytes()
    for layer in range(model.config.num_hidden_layers):
        for head in range(model.config.num_key_value_heads):
            ours, theirs = loaded.cache.kept_entries(layer, 0, head), ctx.cache.kept_entries(layer, 0, head)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    # packed: the file holds the codes, not dequantized entries (positions and validity are 9 bytes an entry)
    entries = int(ctx.cache.head_lengths().sum())
    assert weights.stat().st_size < ctx.cache.kv_nbytes() + 9 * entries + 64 * 1024


def test_a_tier_saved_for_another_shape_is_refused(tiny) -> None:
    model, tokenizer = tiny
    ctx = kvsieve.compress_context(model, tokenizer, CONTEXT, "mixed", budget=48, group=8, value_group=16)
    store = ctx.cache.layers[0].store
    saved = store.entries()
    before = {k: v.clone() for k, v in store.entries().items()}
    broken = {**saved, "tier.0.config": torch.tensor([4, 8, 16])}
    with pytest.raises(ValueError, match=r"tier: key_codes .* \(bits, group, value_group\) = \(4, 8, 16\)"):
        store.restore(broken)
    after = store.entries()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
