"""Measure a DuoAttention head pattern (:mod:`kvsieve.gates.head_pattern`) on calibration passkey prompts.

DuoAttention (Xiao et al. 2024, arXiv:2410.10819, Sec. 3.2) learns which heads need the whole context by
optimising a full-vs-streaming gate per head against the deviation of the model's outputs on synthetic
passkey data. :func:`calibrate_head_pattern` measures that deviation directly, one head at a time and without
gradients: for each (layer, KV head) a cache where only that head streams (``sinks`` + ``recent`` entries,
every other head full) is filled from the same prompt, the passkey answer is teacher-forced, and the head's
score is the mean KL(full ‖ that cache) per answer token, averaged over the calibration prompts. Heads whose
streaming moves the answer most are the retrieval heads. All ``L·H`` caches of one prompt share its prefill
(:func:`kvsieve.engine.shared_prefill.prefill_shared`, ``group`` caches per forward), so a prompt costs one
prefill per group plus ``L·H`` short answer passes.

Calibration prompts come from the passkey generator with seeds from ``seed`` on (``kvsieve eval`` uses seeds
below 10 000 by default: keep ``seed`` ≥ 10 000 so calibration and evaluation never share a prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvsieve.engine.kv_cache import KVCache
from kvsieve.engine.shared_prefill import prefill_shared
from kvsieve.eval.metrics import mean_kl
from kvsieve.eval.passes import forward_logits, teacher_force
from kvsieve.eval.tasks.passkey_prompt import make_passkey_sample
from kvsieve.gates.head_pattern import HeadPattern
from kvsieve.models.architectures import model_info
from kvsieve.models.fingerprint import model_fingerprint

#: First calibration seed: disjoint from the evaluation's sample seeds.
CALIBRATION_SEED = 10_000


def one_head_pattern(layers: int, heads: int, layer: int, head: int, sinks: int, recent: int) -> HeadPattern:
    """A pattern whose only lowest-scored head is ``(layer, head)`` (with ``streaming_share = 1 / (L·H)``)."""
    scores = torch.ones(layers, heads, dtype=torch.float64)
    scores[layer, head] = 0.0
    return HeadPattern(scores, sinks, recent)


def calibrate_head_pattern(
    model: torch.nn.Module,
    tokenizer: Any,
    lengths: Sequence[int] = (1024, 2048),
    samples: int = 2,
    sinks: int = 16,
    recent: int = 112,
    seed: int = CALIBRATION_SEED,
    group: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> HeadPattern:
    """Retrieval score of every (layer, KV head) of ``model`` (see the module docstring).

    Args:
        lengths, samples: calibration prompts — ``samples`` passkey prompts per length, needles at evenly spread
            depths, seeds ``seed, seed + 1, …``.
        sinks, recent: the streaming window measured (``budget = sinks + recent`` at use).
        group: caches filled per shared prefill (memory: each holds the whole prompt until it is compressed).
        progress: called with ``(done, total)`` after each prompt.
    """
    if not lengths or samples < 1 or sinks < 0 or recent < 1 or group < 1:
        raise ValueError("calibrate_head_pattern: need lengths, samples ≥ 1, sinks ≥ 0, recent ≥ 1 and group ≥ 1")
    info = model_info(model)
    layers, heads = info.num_layers, info.num_kv_heads
    share = 1.0 / (layers * heads)
    scores = torch.zeros(layers, heads, dtype=torch.float64)
    prompts = [(length, i) for length in lengths for i in range(samples)]
    device = next(model.parameters()).device
    for done, (length, i) in enumerate(prompts):
        depth = (i + 0.5) / samples
        sample = make_passkey_sample(tokenizer, length, depth, seed + done)
        with torch.inference_mode():
            full = KVCache(model, "full")
            first = forward_logits(model, sample.prompt_ids, full, 1)[-1]
            reference = teacher_force(model, full, first, sample.answer_ids)
            ids = torch.tensor([sample.prompt_ids], dtype=torch.long, device=device)
            pairs = [(layer, head) for layer in range(layers) for head in range(heads)]
            for start in range(0, len(pairs), group):
                chunk = pairs[start : start + group]
                caches = [KVCache(model, "duo_attention", budget=sinks + recent, sinks=sinks, streaming_share=share,
                                  pattern=one_head_pattern(layers, heads, layer, head, sinks, recent))
                          for layer, head in chunk]
                out = prefill_shared(model, ids, caches, logits_to_keep=1)
                logits = out.logits[0, -1].float()
                for (layer, head), cache in zip(chunk, caches, strict=True):
                    cache.flush()
                    rows = teacher_force(model, cache, logits, sample.answer_ids)
                    scores[layer, head] += mean_kl(reference, rows) / len(prompts)
                del caches
        if progress is not None:
            progress(done + 1, len(prompts))
    calibration = {"method": "one-head streaming ablation, KL(full ‖ ablated) per answer token",
                   "task": "passkey", "lengths": list(lengths), "samples": samples, "seed": seed}
    name = str(getattr(model.config, "_name_or_path", "") or "").rstrip("/").split("/")[-1]
    return HeadPattern(scores, sinks, recent, model_fingerprint(model), name, calibration)
