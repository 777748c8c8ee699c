"""KVzip: context reconstruction as probe forwards, against a re-derivation of kvpress's ``KVzipPress``.

The reference runs plain transformers: the context into a ``DynamicCache``, then the repeat prompt + suffix +
context on top of it; per layer it re-projects the probe's queries (``q_proj`` + RoPE), takes the softmax over
every key (one chunk: kvpress's subsampled keys are all of them), the maximum over the probe's queries and
each GQA group, sinks at 1, and prunes the lowest scores over all layers and heads at once.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import build_model
from helpers import prompt
from test_keydiff_expected_attention_cake import pre_rope_queries, run_reference
from test_row_independence import CharTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

import kvsieve
from kvsieve.core.part import PolicyConfigError
from kvsieve.generation.reconstruction import reconstruct
from kvsieve.models.tiny import load_tiny_llama
from kvsieve.transformers_adapter import cache_kwargs

LENGTH, BUDGET = 48, 12
TOKENIZER = CharTokenizer()


def probe_ids(scorer, tokenizer=TOKENIZER) -> list[int]:
    return (list(tokenizer.encode(scorer.repeat_prompt, add_special_tokens=False))
            + list(tokenizer.encode(scorer.prompt_suffix, add_special_tokens=False)))


def kvzip_reference(model, context: torch.Tensor, n_sink: int = 4, tokenizer=TOKENIZER) -> torch.Tensor:
    """``(layers, kv_heads, n)`` kvpress ``score_kvzip`` maxima for a one-chunk context, sinks at 1."""
    scorer = kvsieve.make_policy("kvzip", budget=BUDGET).scorer
    n = context.shape[1]
    repeat = torch.tensor([probe_ids(scorer, tokenizer)], device=context.device)
    full = torch.cat([context, repeat, context], dim=1)  # context, repeat prompt, context
    captured = run_reference(model, full)  # the whole sequence in one forward: same keys as prefill + probe
    scores = []
    for i, (hidden, keys, _) in enumerate(captured):
        module = model.model.layers[i].self_attn
        probe_hidden = hidden[:, n:]
        q_len = probe_hidden.shape[1]
        queries = pre_rope_queries(module, probe_hidden)
        cos, sin = model.model.rotary_emb(probe_hidden, torch.arange(n, n + q_len).unsqueeze(0))
        queries, _ = apply_rotary_pos_emb(queries, queries, cos, sin)
        groups = queries.shape[1] // keys.shape[1]
        logits = queries @ repeat_kv(keys, groups).transpose(2, 3) / math.sqrt(module.head_dim)
        causal = torch.full((q_len, q_len), torch.finfo(logits.dtype).min).triu(1)
        logits[..., -q_len:] += causal
        attention = F.softmax(logits, dim=-1)[..., :n]
        maxima = attention.view(1, keys.shape[1], groups, q_len, n).amax(dim=(2, 3))[0]
        maxima[:, :n_sink] = 1.0
        scores.append(maxima)
    return torch.stack(scores)


def compressed(model, ids, mask=None, **params):
    """Prefill as ``generate`` numbers a padded row (its real tokens from 0), reconstruct, compress."""
    cache = kvsieve.KVCache(model, "kvzip", **{"budget": BUDGET, **params})
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, cache))
        reconstruct(model, TOKENIZER, cache, ids, mask)
    return cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kvzip_keeps_the_reference_global_top_k(arch):
    model = build_model(arch)
    ids = prompt(1, LENGTH, seed=11)
    reference = kvzip_reference(model, ids)
    layers, heads, n = reference.shape
    keep = reference.flatten().topk(layers * heads * BUDGET).indices
    chosen = torch.zeros(layers * heads * n, dtype=torch.bool)
    chosen[keep] = True
    chosen = chosen.view(layers, heads, n)
    cache = compressed(model, ids)
    assert int(cache.head_lengths().sum()) == layers * heads * BUDGET
    assert len({int(x) for x in cache.head_lengths().flatten()}) > 1  # heads and layers keep different counts
    for layer in range(layers):
        for head in range(heads):
            expected = chosen[layer, head].nonzero().flatten().tolist()
            assert cache.kept_positions(layer, 0, head).tolist() == expected, (layer, head)
    assert cache.get_seq_length() == LENGTH  # the probe's tokens are gone


def test_probe_tokens_are_not_kept_and_the_model_continues_the_context():
    """After the reconstruction the cache holds context entries only, and a question continues it at the
    context's positions: its logits equal those of the same kept entries reached without any probe."""
    model = build_model("llama")
    ids = prompt(1, LENGTH, seed=12)
    cache = compressed(model, ids)
    for layer in range(3):
        for head in range(2):
            assert int(cache.kept_positions(layer, 0, head).max()) < LENGTH
    question = prompt(1, 5, seed=13)
    with torch.inference_mode():
        out = model(question, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == LENGTH + 5
    assert bool(torch.isfinite(out.logits).all())
    lengths = cache.head_lengths()
    assert int(lengths.sum()) == 3 * 2 * (BUDGET + 5)  # a KVzip cache never compresses again


def test_chunks_cover_the_context_and_a_single_chunk_matches_one_pass():
    model = build_model("llama")
    ids = prompt(1, LENGTH, seed=14)
    one = compressed(model, ids, chunk_size=LENGTH)
    default = compressed(model, ids)
    assert one.head_lengths().tolist() == default.head_lengths().tolist()
    chunked = compressed(model, ids, chunk_size=16, overlap=3)  # three chunks: every entry scored by one
    store = chunked.layers[0].store
    assert int(chunked.head_lengths().sum()) == 3 * 2 * BUDGET
    assert store is not None


def test_padded_rows_keep_what_they_keep_alone():
    model = build_model("llama")
    short, long = prompt(1, 30, seed=15), prompt(1, 41, seed=16)
    ids = torch.cat([torch.cat([torch.zeros(1, 11, dtype=torch.long), short], dim=1), long])
    mask = torch.ones_like(ids)
    mask[0, :11] = 0
    batch = compressed(model, ids, mask, chunk_size=16)  # rows with 2 and 3 chunks
    for b, (row, pad) in enumerate(((short, 11), (long, 0))):
        alone = compressed(model, row, chunk_size=16)
        for layer in range(3):
            for head in range(2):
                got = (batch.kept_positions(layer, b, head) - pad).tolist()
                assert got == alone.kept_positions(layer, 0, head).tolist(), (b, layer, head)


def test_compress_context_runs_the_reconstruction_once_and_answers():
    model, tokenizer = load_tiny_llama()
    context = " ".join(f"Item {i} is stored in box {(7 * i) % 31}." for i in range(40))
    ctx = kvsieve.compress_context(model, tokenizer, context, "kvzip", budget=24, chat=False)
    layers = len(ctx.cache.layers)
    assert int(ctx.cache.head_lengths().sum()) == layers * ctx.cache.info.num_kv_heads * 24
    held = ctx.cache.head_lengths().clone()
    first = ctx.ask("Which box holds item 12?", max_new_tokens=4)
    again = ctx.ask("Which box holds item 12?", max_new_tokens=4)
    assert first.token_ids == again.token_ids
    assert torch.equal(ctx.cache.head_lengths(), held)  # questions never touch the stored context


def test_without_reconstruction_nothing_is_evicted_and_bad_calls_are_refused():
    model = build_model("llama")
    ids = prompt(1, LENGTH, seed=17)
    cache = kvsieve.KVCache(model, "kvzip", budget=BUDGET)
    with torch.inference_mode():
        model(ids, **cache_kwargs(model, cache))
    assert int(cache.head_lengths().min()) == LENGTH  # no plan before the reconstruction
    with pytest.raises(ValueError, match="holds 48 tokens"):
        reconstruct(model, TOKENIZER, cache, ids[:, :-1])
    snap = kvsieve.KVCache(model, "snapkv", budget=BUDGET, window=4)
    with pytest.raises(ValueError, match="kvzip"):
        reconstruct(model, TOKENIZER, snap, ids)
    with pytest.raises(PolicyConfigError, match="chunk_size"):
        kvsieve.make_policy("kvzip", budget=BUDGET, chunk_size=0)
    with pytest.raises(PolicyConfigError, match="n_sink"):
        kvsieve.make_policy("kvzip", budget=3)


def test_the_evaluation_reconstructs_before_the_questions(tmp_path):
    """``kvsieve eval`` scores a kvzip cache after its reconstruction: the same bytes as snapkv at the budget
    (one global total), on the single-question and the multi-question (one context, several turns) tasks."""
    from kvsieve.cli import main
    from kvsieve.eval.results import read_records

    assert main(["eval", "--model", "tiny-llama", "--policies", "kvzip,snapkv:window=8", "--budgets", "48",
                 "--tasks", "niah_single_1,multiturn", "--lengths", "256", "--workers", "1",
                 "--output-dir", str(tmp_path), "--no-progress"]) == 0
    records = [r for r in read_records(tmp_path / "records.jsonl") if r["policy"] != "full"]
    held = {(r["task"], r["policy"]): r["kv_bytes_held"] for r in records}
    for task in ("niah_single_1", "multiturn"):
        assert held[(task, "kvzip")] == held[(task, "snapkv")] < records[0]["kv_bytes_full"]


def test_decoding_without_a_reconstruction_warns_once_and_evicts_nothing():
    model = build_model("llama")
    ids = prompt(1, LENGTH, seed=18)
    cache = kvsieve.KVCache(model, "kvzip", budget=BUDGET)
    with pytest.warns(UserWarning, match="reconstruct"):
        model.generate(ids, max_new_tokens=3, do_sample=False, **cache_kwargs(model, cache))
    assert int(cache.head_lengths().min()) == LENGTH + 2
