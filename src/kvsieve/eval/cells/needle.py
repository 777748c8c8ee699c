"""The ``needle`` cell kind: how ``kvsieve niah`` scores a passkey sample (``NiahGrid``, the ``niah`` task).

:func:`score_sample` greedy-decodes and teacher-forces the answer with plain forward calls on whatever
cache ``make_cache`` builds, so the same code scores a full cache and any compressed one. Unlike the
``generate`` kind it decodes all ``max_new_tokens`` (no early stop) and teacher-forces the answer in one
forward on a copy of the prefilled cache whatever the policy's schedule, and it has no full-cache
reference to compare with: the figures ``kvsieve niah`` has always reported, so its results stay
comparable with the published ones (``docs/results/main_job/``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from kvsieve.engine.stats import cache_stats
from kvsieve.eval.cells.context import CellContext, prefill
from kvsieve.eval.metrics import first_number, token_logprobs
from kvsieve.eval.passes import forward_logits, greedy, teacher_force
from kvsieve.eval.tasks import TaskSample
from kvsieve.eval.tasks.passkey_prompt import NeedleSample


def _never(text: str) -> bool:
    return False


def score_sample(
    model: PreTrainedModel,
    sample: NeedleSample | TaskSample,
    make_cache: Callable[[], Cache | None],
    max_new_tokens: int = 8,
    prefilled: tuple[Cache, torch.Tensor, float] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> dict[str, Any]:
    """Greedy retrieval and teacher-forced answer log-likelihood of one sample under ``make_cache``.

    ``prefilled`` = ``(cache, last-position logits, seconds)`` skips the prefill (a cache filled by
    :func:`kvsieve.engine.shared_prefill.prefill_shared`); ``decode`` turns ids into text (default: the
    sample's own ``decode``, a :class:`NeedleSample`'s tokenizer).

    One prefill on a fresh cache from ``make_cache`` (None means a plain ``DynamicCache``), then two
    continuations: greedy decoding one token per forward call, and, on a deep copy of the prefilled
    (already compressed) cache, the answer tokens in one forward call (teacher forcing). No position
    ids or attention mask are passed: the model derives positions from the cache length.

    Returns a dict with ``exact_match`` (the first number generated is the pass key), ``contains``
    (the pass key appears anywhere in the generation), ``generated``, ``generated_ids``,
    ``answer_logprob`` (sum over ``answer_ids``), ``answer_logprob_per_token``,
    ``answer_token_logprobs``, ``argmax_match`` (teacher-forced argmax equals every answer token),
    ``prefill_s``, ``decode_s_per_token``, ``teacher_forced_s`` (the one-call answer pass on the copy) and
    ``kv_bytes`` (keys and values held right after the prefill).
    """
    to_text = decode if decode is not None else sample.decode  # type: ignore[union-attr]
    with torch.inference_mode():
        if prefilled is not None:
            cache, first, prefill_s = prefilled
            first = first.reshape(-1, first.shape[-1])[-1]
        else:
            made = make_cache()
            cache = DynamicCache(config=model.config) if made is None else made
            started = time.perf_counter()
            first = forward_logits(model, sample.prompt_ids, cache, 1)[-1]
            prefill_s = time.perf_counter() - started
        kv_bytes = cache_stats(cache)["kv_bytes"]  # what the prefilled (compressed) cache holds
        forced_cache = copy.deepcopy(cache)  # the teacher-forced pass continues from the prefilled cache
        started = time.perf_counter()
        gen = greedy(model, cache, first, max_new_tokens, to_text, _never)
        decode_s = time.perf_counter() - started
        del cache

        started = time.perf_counter()
        rows = teacher_force(model, forced_cache, first, sample.answer_ids, feed_last=True)  # row i: answer_ids[i]
        token_lp = token_logprobs(rows, sample.answer_ids)
        target = torch.tensor(sample.answer_ids, device=rows.device)
        argmax_match = bool((rows.argmax(-1) == target).all())
        teacher_forced_s = time.perf_counter() - started
        del forced_cache

    total = float(token_lp.sum())  # float32 sum, as kvsieve niah has always reported it
    return {
        "exact_match": first_number(gen.text) == sample.answer,
        "contains": sample.answer in gen.text,
        "generated": gen.text,
        "generated_ids": gen.ids,
        "answer_logprob": total,
        "answer_logprob_per_token": total / len(sample.answer_ids),
        "answer_token_logprobs": [float(x) for x in token_lp],
        "argmax_match": argmax_match,
        "prefill_s": prefill_s,
        "decode_s_per_token": decode_s / max(1, len(gen.ids) - 1),
        "teacher_forced_s": teacher_forced_s,
        "kv_bytes": kv_bytes,
    }


def needle_cell(cell: CellContext) -> dict[str, Any]:
    """:func:`score_sample` of the cell, with what a sweep's summary reads: ``score`` (exact match as 0/1),
    ``answer``, ``references``, ``kv_bytes_held`` (= ``kv_bytes``) and ``kv_bytes_full``."""
    prefilled = prefill(cell)  # the shared forward's cache, or this cell's own prefill (and reconstruction)
    scores = score_sample(cell.model, cell.sample, cell.make_cache, cell.task.max_new_tokens, prefilled,
                          decode=cell.tokenizer.decode)
    return {
        "score": float(scores["exact_match"]),
        "answer": cell.sample.answer,
        "references": list(cell.sample.references),
        **scores,
        "kv_bytes_held": scores["kv_bytes"],
        "kv_bytes_full": cell.full_kv_bytes(cell.sample.prompt_tokens),
    }
