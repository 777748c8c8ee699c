"""The ``perplexity`` cell kind: essay text streamed through the cache, NLL by position.

The compressed cache prefills ``max(task.start, budget)`` tokens, then takes ``task.chunk`` tokens per
forward; the full cache's reference (exact in any chunking) is streamed in :data:`PPL_REFERENCE_CHUNK`
chunks and keeps its top :data:`PPL_TOP_K` log-probabilities per position, against which the coarse KL
is read. ``score`` is ``1 / ppl``; ``kv_bytes_held`` is measured after the last token.
"""

from __future__ import annotations

import math
import time
from itertools import pairwise
from typing import Any

import torch

from kvsieve.engine.kv_cache import KVCache
from kvsieve.eval.cells.context import CellContext
from kvsieve.eval.passes import stream_nll
from kvsieve.eval.tasks.perplexity import EssayPerplexity

#: Chunk size of the full-cache perplexity reference (exact in any chunking) and its stored top-k.
PPL_REFERENCE_CHUNK = 256
PPL_TOP_K = 64


def _buckets(nll: torch.Tensor, size: int) -> tuple[list[int], list[float]]:
    """Bucket edges over predicted positions ``1 .. n`` and the perplexity of each bucket."""
    positions = torch.arange(1, len(nll) + 1)
    edges = list(range(0, len(nll) + 1, size))
    if edges[-1] < len(nll) + 1:
        edges.append(len(nll) + 1)
    ppl = []
    for lo, hi in pairwise(edges):
        part = nll[(positions >= lo) & (positions < hi)]
        ppl.append(math.exp(float(part.double().mean())) if len(part) else math.nan)
    return edges, ppl


def perplexity_cell(cell: CellContext) -> dict[str, Any]:
    """Mean NLL and perplexity (and per bucket of positions) beside the full cache's, coarse KL, KV bytes."""
    model, sample, task = cell.model, cell.sample, cell.task
    assert isinstance(task, EssayPerplexity)
    ids = sample.prompt_ids
    extra = f"ppl:chunk={PPL_REFERENCE_CHUNK}:top={PPL_TOP_K}"
    ref = cell.load(extra)
    cached = ref is not None
    pair = None if ref is None else (ref["top_ids"].long(), ref["top_logprobs"])

    def full_run(reference: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[Any, KVCache, float]:
        cache = KVCache(model, "full")
        t0 = time.perf_counter()
        out = stream_nll(model, cache, ids, PPL_REFERENCE_CHUNK, PPL_REFERENCE_CHUNK, PPL_TOP_K, reference)
        return out, cache, time.perf_counter() - t0

    if cell.is_full:
        result, cache, run_s = full_run(pair)
        prefill = PPL_REFERENCE_CHUNK
        full_nll = result.nll if ref is None else ref["nll"]
    else:
        if ref is None:
            full_result, _, _ = full_run(None)
            ref = {
                "nll": full_result.nll, "top_ids": full_result.top_ids.int(), "top_logprobs": full_result.top_logprobs,
            }
            pair = (full_result.top_ids, full_result.top_logprobs)
        cache = cell.make_cache()
        prefill = min(len(ids) - 1, max(task.start, cell.budget or 0))
        t0 = time.perf_counter()
        result = stream_nll(model, cache, ids, prefill, task.chunk, PPL_TOP_K, pair)
        run_s = time.perf_counter() - t0
        full_nll = ref["nll"]
    if ref is None:  # the full cell is its own reference
        ref = {"nll": result.nll, "top_ids": result.top_ids.int(), "top_logprobs": result.top_logprobs}
    if not cached:
        cell.save(ref, extra)
    nll, full_nll = result.nll.double(), full_nll.double()
    mean_nll, mean_full = float(nll.mean()), float(full_nll.mean())
    edges, buckets = _buckets(result.nll, task.bucket)
    _, buckets_full = _buckets(full_nll, task.bucket)
    assert result.kl is not None
    return {
        "score": task.score_nll(mean_nll),
        "generated": "",
        "nll": mean_nll,
        "ppl": math.exp(mean_nll),
        "nll_full": mean_full,
        "ppl_full": math.exp(mean_full),
        "answer_logprob": -float(nll.sum()),
        "answer_logprob_full": -float(full_nll.sum()),
        "logprob_gap": float(nll.sum() - full_nll.sum()),
        "kl_full_compressed": float(result.kl.mean()),
        "ppl_bucket_edges": edges,
        "ppl_buckets": buckets,
        "ppl_buckets_full": buckets_full,
        "nll_positions": [round(float(x), 4) for x in result.nll],
        "chunk": PPL_REFERENCE_CHUNK if cell.is_full else task.chunk,
        "prefill_tokens": prefill,
        "kv_bytes_held": cache.kv_nbytes(),
        "kv_bytes_full": cell.full_kv_bytes(len(ids) - 1),
        "decode_s": run_s,
        "reference_cached": cached,
    }
