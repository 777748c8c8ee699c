"""The ``generate`` cell kind: one prompt, one answer (RULER's tasks, the eval sweep's ``passkey``).

From one prefill, the canonical answer is teacher-forced and the model decodes greedily: under the
``prefill`` schedule the answer goes in one forward on a ``copy.deepcopy`` of the prefilled cache; when
the policy acts during decoding (:func:`kvsieve.eval.passes.needs_stepwise`) it goes one token per
forward, sharing the decoding steps while the model generates the answer itself
(:func:`kvsieve.eval.passes.greedy`). Decoding stops once the score cannot change. The full cache's
answer rows are the reference (computed once per sample).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from kvsieve.engine.kv_cache import KVCache
from kvsieve.eval.cells.context import CellContext, answer_fields, prefill
from kvsieve.eval.metrics import token_logprobs
from kvsieve.eval.passes import forward_logits, greedy, teacher_force


def generate_cell(cell: CellContext) -> dict[str, Any]:
    """Score, generation, answer log-likelihood and KL against the full cache, KV bytes and timings."""
    model, sample, task = cell.model, cell.sample, cell.task
    ref = cell.load()
    cache, first, prefill_s = prefill(cell)
    held = cache.kv_nbytes()
    started = time.perf_counter()

    def stop(text: str) -> bool:
        return task.done(sample, text)

    if cell.stepwise:
        gen = greedy(model, cache, first, task.max_new_tokens, cell.decode, stop, answer_ids=sample.answer_ids)
        assert gen.answer_rows is not None
        rows = gen.answer_rows
    else:
        tf_cache = copy.deepcopy(cache)
        rows = teacher_force(model, tf_cache, first, sample.answer_ids)
        del tf_cache
        gen = greedy(model, cache, first, task.max_new_tokens, cell.decode, stop)
    decode_s = time.perf_counter() - started
    cached = ref is not None
    if ref is None:
        if cell.is_full and not cell.stepwise:
            ref = {"rows": rows, "answer_logprobs": token_logprobs(rows, sample.answer_ids)}
        else:
            full_cache = KVCache(model, "full")
            full_first = forward_logits(model, sample.prompt_ids, full_cache, 1)[-1]
            full_rows = teacher_force(model, full_cache, full_first, sample.answer_ids)
            ref = {"rows": full_rows, "answer_logprobs": token_logprobs(full_rows, sample.answer_ids)}
        cell.save(ref)
    return {
        "score": task.score(sample, gen.text),
        "generated": gen.text,
        "references": list(sample.references),
        "answer": sample.answer,
        "answer_tokens": len(sample.answer_ids),
        "generated_tokens": len(gen.ids),
        **answer_fields(rows, ref, sample.answer_ids),
        "kv_bytes_held": held,
        "kv_bytes_full": cell.full_kv_bytes(sample.prompt_tokens),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "reference_cached": cached,
    }
