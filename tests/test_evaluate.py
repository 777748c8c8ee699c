"""``evaluate_cell`` end to end on a tiny random Llama with SmolLM2's tokenizer (no weights loaded)."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvsieve import KVCache
from kvsieve.eval.evaluate import evaluate_cell
from kvsieve.eval.passes import forward_logits, greedy, needs_stepwise, teacher_forced_logprobs
from kvsieve.policies import make_policy

REQUIRED = (
    "task", "policy", "budget", "length", "sample", "seed", "prompt_tokens", "score", "generated",
    "answer_logprob", "answer_logprob_full", "logprob_gap", "kl_full_compressed", "kv_bytes_held",
    "kv_bytes_full", "elapsed_s",
)


@pytest.fixture(scope="module")
def tokenizer():
    from kvsieve.models.default_tokenizer import load_default_tokenizer

    try:
        return load_default_tokenizer()
    except ModuleNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def tiny(tokenizer):
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _cell(tiny, tokenizer, task, policy, budget=None, params=None, reference_dir=None, length=512):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "keeps every entry" on the full-length teacher-forcing forward
        record = evaluate_cell(tiny, tokenizer, task, policy, budget, length, 0, 0, params, reference_dir)
    assert all(key in record for key in REQUIRED), set(REQUIRED) - set(record)
    json.dumps(record, allow_nan=False)  # flat and JSON-serialisable
    assert 0.0 <= record["score"] <= 1.0
    return record


def test_full_cache_is_its_own_reference(tiny, tokenizer, tmp_path):
    record = _cell(tiny, tokenizer, "niah_single_2", "full", reference_dir=tmp_path)
    assert record["logprob_gap"] == 0.0 and record["kl_full_compressed"] == 0.0
    assert record["answer_logprob"] == record["answer_logprob_full"]
    assert record["kv_bytes_held"] == record["kv_bytes_full"] > 0
    assert abs(record["prompt_tokens"] - 512) <= 0.03 * 512 and record["length"] == 512
    assert not record["reference_cached"]
    files = list(tmp_path.iterdir())
    assert [f.suffix for f in files] == [".safetensors"]
    again = _cell(tiny, tokenizer, "niah_single_2", "full", reference_dir=tmp_path)
    assert again["reference_cached"] and again["kl_full_compressed"] == 0.0 and again["logprob_gap"] == 0.0


@pytest.mark.parametrize(
    ("policy", "params"), [("snapkv", None), ("streaming_llm", {"schedule": "decode"}), ("h2o", {"schedule": "decode"})]
)
def test_compressing_policy_differs_from_full(tiny, tokenizer, tmp_path, policy, params):
    full = _cell(tiny, tokenizer, "niah_multikey_1", "full", reference_dir=tmp_path)
    record = _cell(tiny, tokenizer, "niah_multikey_1", policy, 64, params, reference_dir=tmp_path)
    assert record["reference_cached"]
    assert record["kl_full_compressed"] > 0.0
    assert record["answer_logprob_full"] == full["answer_logprob"]
    assert record["logprob_gap"] == pytest.approx(full["answer_logprob"] - record["answer_logprob"])
    assert record["kv_bytes_held"] < record["kv_bytes_full"] == full["kv_bytes_full"]
    assert record["budget"] == 64 and record["policy"] == policy


def test_reference_without_a_folder_matches_the_saved_one(tiny, tokenizer, tmp_path):
    saved = _cell(tiny, tokenizer, "vt", "tova", 48, reference_dir=tmp_path)
    fresh = _cell(tiny, tokenizer, "vt", "tova", 48)
    assert not fresh["reference_cached"]
    assert fresh["answer_logprob_full"] == saved["answer_logprob_full"]
    assert fresh["kl_full_compressed"] == saved["kl_full_compressed"]


def test_passkey_record_carries_depth(tiny, tokenizer):
    record = _cell(tiny, tokenizer, "passkey", "full")
    assert record["depth"] == 0.1 and record["generated_tokens"] <= 8


def test_multiturn_record(tiny, tokenizer):
    full = _cell(tiny, tokenizer, "multiturn", "full")
    assert len(full["turn_scores"]) == len(full["turn_generated"]) == 4
    assert full["score"] == sum(full["turn_scores"]) / 4
    assert full["turn_kl"] == [0.0] * 4 and full["logprob_gap"] == 0.0
    record = _cell(tiny, tokenizer, "multiturn", "snapkv", 32)
    assert record["kl_full_compressed"] > 0 and len(record["turn_answer_logprobs"]) == 4
    assert record["turn_answer_logprobs_full"] == full["turn_answer_logprobs"]


def test_perplexity_record(tiny, tokenizer, tmp_path):
    full = _cell(tiny, tokenizer, "perplexity_chunk16", "full", reference_dir=tmp_path, length=300)
    assert full["ppl"] == full["ppl_full"] and full["kl_full_compressed"] == 0.0
    assert len(full["nll_positions"]) == 299 and full["ppl_bucket_edges"] == [0, 256, 300]
    assert full["score"] == pytest.approx(1 / full["ppl"])
    record = _cell(
        tiny, tokenizer, "perplexity_chunk16", "streaming_llm", 64, {"schedule": "decode"}, tmp_path, length=300
    )
    assert record["reference_cached"] and record["nll_full"] == full["nll"]
    assert record["kl_full_compressed"] > 0 and record["prefill_tokens"] == 64
    assert record["kv_bytes_held"] < record["kv_bytes_full"]


def test_unknown_policy_fails_before_work(tiny, tokenizer):
    with pytest.raises(ValueError, match="unknown policy"):
        evaluate_cell(tiny, tokenizer, "vt", "no_such_policy", 64, 512, 0, 0)


def test_shared_greedy_rows_equal_separate_teacher_forcing(tiny, tokenizer):
    """Decoding while on the answer is teacher forcing: the shared rows equal a separate pass."""
    prompt = tokenizer("The grass is green. The sky is blue. " * 20).input_ids
    policy = make_policy("streaming_llm", budget=48, schedule="decode")
    assert needs_stepwise(policy) and not needs_stepwise(make_policy("snapkv", budget=48))

    def decode(ids):
        return tokenizer.decode(ids)

    with torch.inference_mode():
        cache = KVCache(tiny, policy)
        first = forward_logits(tiny, prompt, cache, 1)[-1]
        own = greedy(tiny, copy.deepcopy(cache), first, 6, decode, lambda text: False).ids
        for answer in (own[:4], [*own[:2], own[2] + 1, 7, 8], [own[0] + 1, 5, 6]):
            gen = greedy(tiny, copy.deepcopy(cache), first, 6, decode, lambda text: False, answer_ids=answer)
            assert gen.ids == own and gen.copies == int(answer != own[: len(answer)])
            separate = teacher_forced_logprobs(tiny, KVCache(tiny, policy), prompt, answer, stepwise=True)
            assert torch.allclose(gen.answer_rows, separate, atol=1e-6)


TIMINGS = ("elapsed_s", "prefill_s", "decode_s", "prefill_shared", "reference_cached")


@pytest.mark.parametrize("task", ["niah_single_1", "multiturn"])
def test_cells_sharing_one_prefill_give_the_records_of_separate_cells(tiny, tokenizer, tmp_path, task):
    from kvsieve.eval.evaluate import evaluate_cells

    cells = [
        ("snapkv", 32, None), ("full", None, None), ("h2o", 32, {"schedule": "decode"}),
        ("h2o", 32, {"schedule": "blockwise", "block_size": 64}), ("tova", 48, None),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        together = evaluate_cells(tiny, tokenizer, task, cells, 384, 1, 0)
        apart = [evaluate_cell(tiny, tokenizer, task, p, b, 384, 1, 0, params) for p, b, params in cells]
    assert [r["prefill_shared"] for r in together] == [4, 4, 4, 1, 4]
    assert [r["policy"] for r in together] == [c[0] for c in cells]
    for joint, alone in zip(together, apart, strict=True):
        assert {k: v for k, v in joint.items() if k not in TIMINGS} == {
            k: v for k, v in alone.items() if k not in TIMINGS
        }
    assert all(r["reference_cached"] for r in together if r["policy"] != "full")


def test_cells_validate_every_policy_before_work(tiny, tokenizer):
    from kvsieve.eval.evaluate import evaluate_cells
    from kvsieve.policies import PolicyConfigError

    with pytest.raises(PolicyConfigError, match="window"):
        evaluate_cells(tiny, tokenizer, "vt", [("full", None, None), ("snapkv", 8, None)], 8, 0, 0)


def test_niah_shared_prefill_matches_separate_scoring(tiny, tokenizer):
    from kvsieve.eval.cells.needle import score_sample
    from kvsieve.eval.niah import run_niah
    from kvsieve.eval.tasks.passkey_prompt import make_passkey_sample

    caches = {
        "full": ("full", None, None),
        "snapkv": ("snapkv", 32, None),
        "h2o": ("h2o", 32, {"schedule": "decode"}),
        "tova_bw": ("tova", 32, {"schedule": "blockwise", "block_size": 64}),
    }
    factories = {
        "full": lambda: None,
        "snapkv": lambda: KVCache(tiny, "snapkv", budget=32),
        "h2o": lambda: KVCache(tiny, "h2o", budget=32, schedule="decode"),
        "tova_bw": lambda: KVCache(tiny, "tova", budget=32, schedule="blockwise", block_size=64),
    }
    records = run_niah(tiny, tokenizer, lengths=[256], depths=[0.5], caches=caches, progress=False, max_new_tokens=4)
    sample = make_passkey_sample(tokenizer, 256, 0.5, 0)
    volatile = ("prefill_s", "decode_s_per_token", "teacher_forced_s", "prefill_shared")
    for record in records:
        alone = score_sample(tiny, sample, factories[record["name"]], max_new_tokens=4)
        assert {k: v for k, v in alone.items() if k not in volatile and k != "generated_ids"} == {
            k: record[k] for k in alone if k not in volatile and k != "generated_ids"
        }
        assert (record["context_tokens"], record["depth"], record["seed"]) == (256, 0.5, 0)
    assert {r["name"]: r["prefill_shared"] for r in records} == {"full": 1, "snapkv": 2, "h2o": 2, "tova_bw": 1}


def test_niah_records_are_the_sweep_records_of_the_needle_kind(tiny, tokenizer):
    """``kvsieve niah`` is a sweep of the shared cells: its records are evaluate_cells' of the ``niah`` task."""
    from kvsieve.eval.evaluate import evaluate_cells
    from kvsieve.eval.niah import RECORD_FIELDS, run_niah
    from kvsieve.eval.tasks.passkey import NiahGrid

    caches = {"full": ("full", None, None), "snapkv@32": ("snapkv", 32, None)}
    records = run_niah(tiny, tokenizer, lengths=[128], depths=[0.2, 0.8], seeds=[3], caches=caches, progress=False,
                       max_new_tokens=3)
    assert [(r["name"], r["depth"]) for r in records] == [("full", 0.2), ("snapkv@32", 0.2), ("full", 0.8),
                                                          ("snapkv@32", 0.8)]
    cells = evaluate_cells(tiny, tokenizer, NiahGrid(depths=(0.2, 0.8), max_new_tokens=3), list(caches.values()),
                           128, 1, 3)
    volatile = ("prefill_s", "decode_s_per_token", "teacher_forced_s")
    for record, cell in zip(records[2:], cells, strict=True):
        assert cell["task"] == "niah" and cell["score"] == float(cell["exact_match"])
        assert {k: record[k] for k in RECORD_FIELDS if k not in volatile} == {
            k: cell[k] for k in RECORD_FIELDS if k not in volatile
        }
    assert cells[0]["policy_desc"] == "DynamicCache"


def test_eval_sweep_runs_the_niah_task(tmp_path):
    """``kvsieve eval --tasks niah``: the same cells as ``kvsieve niah``, in a sweep folder with its summary."""
    from kvsieve.eval.runner import run_sweep
    from kvsieve.eval.sweep_config import SweepConfig
    from kvsieve.policies.spec import PolicySpec

    config = SweepConfig(policies=[PolicySpec("snapkv")], budgets=[32], tasks=["niah"], lengths=[128], samples=2,
                         output_dir=str(tmp_path / "eval"), workers=1, threads=1, model="tiny-llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcome = run_sweep(config, progress=False)
    assert (outcome.ran, outcome.failed) == (4, 0)
    full, snap = (next(r for r in outcome.rows if r["policy"] == p) for p in ("full", "snapkv"))
    assert full["kv_ratio"] == 1.0 and 0 < snap["kv_ratio"] < 1
    assert full["samples"] == snap["samples"] == 2


def test_niah_progress_is_one_short_line(tiny, tokenizer, capsys):
    """The postfix used to carry every configuration's running hit count, thousands of characters long."""
    from kvsieve.eval.niah import run_niah

    caches = {"full": ("full", None, None), **{f"snapkv@{b}": ("snapkv", b, None) for b in (32, 48, 64, 96, 112)}}
    run_niah(tiny, tokenizer, lengths=[128], depths=[0.2, 0.8], caches=caches, progress=True, max_new_tokens=2)
    updates = [u for u in capsys.readouterr().err.replace("\r", "\n").splitlines() if u.startswith("niah")]
    assert updates and max(len(u) for u in updates) < 120, max(updates, key=len)
