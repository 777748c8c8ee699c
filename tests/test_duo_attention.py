"""DuoAttention's head split: retrieval heads keep everything, streaming heads sinks + recent entries; head
patterns (save, load, model checks); the gradient-free calibration; the pattern shipped for the default model."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from helpers import prompt, random_pattern

import kvsieve
from kvsieve.core.part import PolicyConfigError
from kvsieve.gates.head_pattern import HeadPattern, load_pattern
from kvsieve.models.tiny import load_tiny_llama
from kvsieve.train.duo import calibrate_head_pattern, one_head_pattern
from kvsieve.transformers_adapter import cache_kwargs

LENGTH, BUDGET, SINKS = 40, 12, 3


def filled(model, ids, mask=None, **params):
    cache = kvsieve.KVCache(model, "duo_attention", budget=BUDGET, sinks=SINKS, **params)
    with torch.inference_mode():
        model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    cache.head_lengths()
    return cache


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_streaming_heads_keep_sinks_and_recent_retrieval_heads_everything(share):
    model = build_model("llama")
    pattern = random_pattern(model, seed=3)
    cache = filled(model, prompt(1, LENGTH, seed=1), pattern=pattern, streaming_share=share)
    streaming = pattern.streaming_mask(share)
    assert int(streaming.sum()) == round(share * streaming.numel())
    scores = pattern.scores.flatten()
    if 0 < share < 1:  # the lowest-scored heads stream
        assert float(scores[streaming.flatten()].max()) < float(scores[~streaming.flatten()].min())
    for layer in range(3):
        for head in range(2):
            kept = cache.kept_positions(layer, 0, head).tolist()
            if streaming[layer, head]:
                assert kept == list(range(SINKS)) + list(range(LENGTH - (BUDGET - SINKS), LENGTH))
            else:
                assert kept == list(range(LENGTH))


def test_streaming_heads_roll_while_decoding_and_padded_rows_match_alone():
    model = build_model("llama")
    pattern = random_pattern(model, seed=4)
    short, long = prompt(1, 25, seed=5), prompt(1, 33, seed=6)
    ids = torch.cat([torch.cat([torch.zeros(1, 8, dtype=torch.long), short], dim=1), long])
    mask = torch.ones_like(ids)
    mask[0, :8] = 0
    batch = filled(model, ids, mask, pattern=pattern, schedule="decode")
    alone = filled(model, short, pattern=pattern, schedule="decode")
    for layer in range(3):
        for head in range(2):
            assert (batch.kept_positions(layer, 0, head) - 8).tolist() == alone.kept_positions(layer, 0, head).tolist()
    with torch.inference_mode():
        model(torch.full((2, 1), 7), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
              **cache_kwargs(model, batch))
    streaming = pattern.streaming_mask(0.5)
    lengths = batch.head_lengths()
    assert bool((lengths[streaming.nonzero(as_tuple=True)[0], :, streaming.nonzero(as_tuple=True)[1]] == BUDGET).all())


def test_pattern_roundtrip_and_model_checks(tmp_path):
    model = build_model("llama")
    pattern = random_pattern(model, seed=7)
    path = HeadPattern(pattern.scores, 4, 12, "sha256:0000", "tiny", {"method": "test"}).save(tmp_path / "p")
    loaded = load_pattern(path)
    assert torch.equal(loaded.scores, pattern.scores.double()) and loaded.calibration == {"method": "test"}
    with pytest.raises(ValueError, match="measured on weights sha256:0000"):
        kvsieve.KVCache(model, "duo_attention", budget=BUDGET, sinks=SINKS, pattern=str(path))
    wrong = HeadPattern(torch.ones(2, 2, dtype=torch.float64), 4, 12)
    with pytest.raises(ValueError, match="layers, KV heads"):
        kvsieve.KVCache(model, "duo_attention", budget=BUDGET, sinks=SINKS, pattern=wrong)
    with pytest.raises(FileNotFoundError, match="calibrate-duo"):
        kvsieve.KVCache(model, "duo_attention", budget=BUDGET, sinks=SINKS)  # no shipped pattern for a random model
    with pytest.raises(PolicyConfigError, match="streaming_share"):
        kvsieve.make_policy("duo_attention", budget=BUDGET, streaming_share=1.5)
    with pytest.raises(PolicyConfigError, match="sinks"):
        kvsieve.make_policy("duo_attention", budget=BUDGET, sinks=BUDGET + 1)


def test_calibration_scores_each_head_by_its_own_streaming_ablation():
    """The score of a head is the answer KL when that head alone streams: recomputed here for two heads."""
    from kvsieve.eval.metrics import mean_kl
    from kvsieve.eval.passes import forward_logits, teacher_force
    from kvsieve.eval.tasks.passkey_prompt import make_passkey_sample

    model, tokenizer = load_tiny_llama()
    pattern = calibrate_head_pattern(model, tokenizer, lengths=(200,), samples=1, sinks=4, recent=28, group=3)
    layers, heads = pattern.scores.shape
    sample = make_passkey_sample(tokenizer, 200, 0.5, 10_000)
    with torch.inference_mode():
        full = kvsieve.KVCache(model, "full")
        reference = teacher_force(model, full, forward_logits(model, sample.prompt_ids, full, 1)[-1], sample.answer_ids)
        for layer, head in ((0, 0), (layers - 1, heads - 1)):
            cache = kvsieve.KVCache(model, "duo_attention", budget=32, sinks=4, streaming_share=1 / (layers * heads),
                                    pattern=one_head_pattern(layers, heads, layer, head, 4, 28))
            rows = teacher_force(model, cache, forward_logits(model, sample.prompt_ids, cache, 1)[-1],
                                 sample.answer_ids)
            assert pattern.scores[layer, head].item() == pytest.approx(mean_kl(reference, rows), rel=1e-4, abs=1e-7)
    assert bool((pattern.scores >= 0).all()) and float(pattern.scores.max()) > 0


@pytest.mark.slow
def test_the_shipped_pattern_loads_for_the_default_model():
    from kvsieve.models.default_model import load_default_model

    model, _ = load_default_model(dtype=torch.float32)
    cache = kvsieve.KVCache(model, "duo_attention", budget=128)
    streaming = cache.policy.scorer.streaming_heads(18, 3, torch.device("cpu"))
    assert not bool(streaming[2])  # the head whose streaming moves the passkey answer most is a retrieval head
    assert int(sum(int(cache.policy.scorer.streaming_heads(i, 3, torch.device("cpu")).sum()) for i in range(30))) == 45
