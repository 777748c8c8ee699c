"""One benchmark configuration in a fresh process: ``python -m kvsieve.bench.worker < spec.json``.

The spec names the model, dtype, threads, context length, cache (policy, params, budget), batch sizes,
warm-up and timed decoding steps. The worker loads the model, pages its weights in with a short
forward, prefills the batch-1 prompt once (timed), then for each batch size in ascending order decodes
from its own copy of the prefilled cache replicated to that batch (a batch of identical prompts holds
exactly that, without paying batch × prefill). Peak RSS is read from ``VmHWM``, reset before the prefill
and before each batch, so each phase's peak is its own; the whole-process peak is kept too.
The result is printed as one JSON line after :data:`RESULT_MARKER`.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from typing import Any

import torch

from kvsieve.bench.measure import (
    decode_latencies,
    make_cache,
    peak_rss_bytes,
    prompt_ids,
    reset_peak_rss,
    rss_bytes,
    timed_prefill,
)
from kvsieve.engine.stats import cache_stats
from kvsieve.models.loading import load_model

RESULT_MARKER = "KVSIEVE_BENCH_RESULT "


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _decode_batch(
    model: torch.nn.Module, cache: Any, token: torch.Tensor, batch: int, spec: dict[str, Any]
) -> dict[str, Any]:
    rss_before = rss_bytes()
    work = copy.deepcopy(cache)
    if batch > 1:
        work.batch_repeat_interleave(batch)
    tokens = token.repeat(batch, 1)
    _, tokens = decode_latencies(model, work, tokens, spec["warmup"])
    latencies, _ = decode_latencies(model, work, tokens, spec["steps"])
    peak = peak_rss_bytes()
    stats = cache_stats(work)
    del work
    return {
        "batch": batch,
        "decode_tokens_per_s": len(latencies) * batch / sum(latencies),
        "latency_ms_median": 1000 * statistics.median(latencies),
        "latency_ms_p90": 1000 * _quantile(latencies, 0.9),
        "rss_before_bytes": rss_before,
        "decode_peak_rss_bytes": peak,
        "decode_extra_rss_bytes": None if rss_before is None else peak - rss_before,
        "kv_bytes": stats["kv_bytes"],
        "cache_nbytes": stats["nbytes"],
        "peak_head_length": stats["peak_head_length"],
    }


def run_configuration(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one (model, length, cache) over ``spec["batches"]``; see the module docstring."""
    torch.set_num_threads(int(spec["threads"]))
    rss_start = rss_bytes()
    model, tokenizer = load_model(spec["model"], spec["dtype"], spec.get("device", "cpu"))
    length = int(spec["length"])
    limit = getattr(model.config, "max_position_embeddings", None)
    needed = length + spec["warmup"] + spec["steps"]
    if limit is not None and needed > limit:
        raise ValueError(f"context {length} + {spec['warmup'] + spec['steps']} decoding steps exceeds the "
                         f"model's {limit} positions")
    ids = prompt_ids(tokenizer, length).to(model.device)
    process_peak = 0
    with torch.no_grad():
        model(ids[:, :8], use_cache=False)  # page the weights in and warm the kernels, for every cache alike
        rss_model = rss_bytes()
        process_peak = max(process_peak, peak_rss_bytes())
        reset_supported = reset_peak_rss()
        cache = make_cache(model, spec["policy"], spec["budget"], spec.get("params"))
        prefill_s, token = timed_prefill(model, ids, cache)
        prefill_peak = peak_rss_bytes()
        after_prefill = cache_stats(cache)
        batches = []
        for batch in sorted(spec["batches"]):
            process_peak = max(process_peak, peak_rss_bytes())
            reset_peak_rss()
            batches.append(_decode_batch(model, cache, token, batch, spec))
        process_peak = max(process_peak, peak_rss_bytes())
    return {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": length / prefill_s,
        "rss_start_bytes": rss_start,
        "rss_model_bytes": rss_model,
        "prefill_peak_rss_bytes": prefill_peak,
        "process_peak_rss_bytes": process_peak,
        "peak_reset_supported": reset_supported,
        "prefill_kv_bytes": after_prefill["kv_bytes"],
        "prefill_peak_head_length": after_prefill["peak_head_length"],
        "batches": batches,
    }


def main() -> None:
    spec = json.loads(sys.stdin.read())
    result = run_configuration(spec)
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
