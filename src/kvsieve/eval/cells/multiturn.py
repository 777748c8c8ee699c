"""The ``multiturn`` cell kind: several needles in one context, asked one per turn on the same cache.

Teacher forcing of every turn's answer runs on a copy of the prefilled cache, one token per forward,
each turn's last answer token fed with the next question (as after decoding); greedy decoding answers
turn by turn on the cache itself. ``score`` is the mean of the turn scores.
"""

from __future__ import annotations

import copy
import time
from itertools import pairwise
from typing import Any

import torch

from kvsieve.engine.kv_cache import KVCache
from kvsieve.eval.cells.context import CellContext, answer_fields, prefill
from kvsieve.eval.metrics import kl_per_position, token_logprobs
from kvsieve.eval.passes import forward_logits, greedy, teacher_force
from kvsieve.eval.tasks.multiturn import MultiTurnRetrieval


def _dialogue_rows(
    model: torch.nn.Module, cache: KVCache, first: torch.Tensor, questions: list[list[int]], answers: list[list[int]]
) -> torch.Tensor:
    """Teacher-forced rows of every turn's answer, the answers fed one token per forward.

    Each turn's last answer token is fed together with the next question, as after decoding.
    """
    rows, logits = [], first
    for turn, answer in enumerate(answers):
        if turn:
            logits = forward_logits(model, [answers[turn - 1][-1], *questions[turn]], cache, 1)[-1]
        rows.append(teacher_force(model, cache, logits, answer, stepwise=True))
    return torch.cat(rows)


def multiturn_cell(cell: CellContext) -> dict[str, Any]:
    """Per-turn scores, generations, answer log-likelihoods and KL, and their means over the dialogue."""
    model, sample, task = cell.model, cell.sample, cell.task
    assert isinstance(task, MultiTurnRetrieval)
    questions: list[list[int]] = sample.meta["turn_question_ids"]
    answers: list[list[int]] = sample.meta["turn_answer_ids"]
    flat_answer = [tok for answer in answers for tok in answer]
    ref = cell.load()
    cache, first, prefill_s = prefill(cell)
    held = cache.kv_nbytes()
    started = time.perf_counter()
    tf_cache = copy.deepcopy(cache)
    rows = _dialogue_rows(model, tf_cache, first, questions, answers)
    del tf_cache
    texts, logits, generated = [], first, 0
    pending: list[int] = []
    for turn in range(len(answers)):
        if turn:
            logits = forward_logits(model, [*pending, *questions[turn]], cache, 1)[-1]

        def stop(text: str, turn: int = turn) -> bool:
            return task.turn_done(sample, turn, text)

        gen = greedy(model, cache, logits, task.max_new_tokens, cell.decode, stop)
        texts.append(gen.text)
        # The last token is fed with the next question, unless it ended the line (the question starts one).
        pending = [] if "\n" in cell.decode(gen.ids[-1:]) else gen.ids[-1:]
        generated += len(gen.ids)
    decode_s = time.perf_counter() - started
    cached = ref is not None
    if ref is None:
        if cell.is_full:
            full_rows = rows
        else:
            full_cache = KVCache(model, "full")
            full_first = forward_logits(model, sample.prompt_ids, full_cache, 1)[-1]
            full_rows = _dialogue_rows(model, full_cache, full_first, questions, answers)
        ref = {"rows": full_rows, "answer_logprobs": token_logprobs(full_rows, flat_answer)}
        cell.save(ref)
    bounds = [0]
    for answer in answers:
        bounds.append(bounds[-1] + len(answer))
    own_lp = token_logprobs(rows, flat_answer).double()
    full_lp = ref["answer_logprobs"].double()
    kl = kl_per_position(ref["rows"], rows)
    turn_scores = [task.score_turn(sample, t, text) for t, text in enumerate(texts)]
    return {
        "score": sum(turn_scores) / len(turn_scores),
        "generated": "\n".join(texts),
        "references": list(sample.references),
        "answer": " | ".join(sample.references),
        "answer_tokens": len(flat_answer),
        "generated_tokens": generated,
        **answer_fields(rows, ref, flat_answer),
        "turn_scores": turn_scores,
        "turn_generated": texts,
        "turn_answer_logprobs": [float(own_lp[a:b].sum()) for a, b in pairwise(bounds)],
        "turn_answer_logprobs_full": [float(full_lp[a:b].sum()) for a, b in pairwise(bounds)],
        "turn_kl": [float(kl[a:b].mean()) for a, b in pairwise(bounds)],
        "kv_bytes_held": held,
        "kv_bytes_full": cell.full_kv_bytes(sample.prompt_tokens),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "reference_cached": cached,
    }
