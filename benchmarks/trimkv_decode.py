"""Decoding throughput of ``dbtrimkv`` (ragged global budget) vs the full cache and ``snapkv`` (issue 12, item 7).

For each context length ``T`` (default 4096, 8192) and batch size (1, 8; batch 8 = eight different essay
prompts) the caches are filled once with a ``T``-token prompt: ``full`` (``KVCache(model, "full")``),
``snapkv`` at ``B`` entries per head, and ``dbtrimkv`` at the same ``B`` — the same total bytes
(``L·H·B`` entries per row), but ragged across layers and heads, and evicting during decoding whenever a
row holds more than its budget plus the buffer (the work ``snapkv`` never does). One shared prompt forward
(:func:`kvsieve.prefill_shared`, the full cache leading) fills all three. Each of ``--rounds``
rounds deep-copies the filled caches, runs one warm-up step each, then ``--steps`` single-token forwards
per cache, interleaved step by step (:func:`engine_overhead.interleaved_decode`). Reported: median seconds
per step, tokens/s (batch / step time), and the ratios ``dbtrimkv/snapkv`` and ``full/dbtrimkv``; the
entries held per head; the CPU, bf16 support, dtype and threads (``engine_overhead`` helpers).

Usage: ``python benchmarks/trimkv_decode.py [--tokens 4096,8192] [--batches 1,8] [--budget 256]
[--rounds 3] [--steps 8] [--threads 1] [--output benchmarks/results/trimkv_decode.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_overhead as eo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="4096,8192")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--output", default="benchmarks/results/trimkv_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = eo.cpu_info()
    dtype, dtype_note = eo.pick_dtype(args.dtype, cpu["bf16_native"])
    from kvsieve import KVCache, prefill_shared
    from kvsieve.models.default_model import load_default_model

    model, tokenizer = load_default_model(dtype=dtype)
    lengths = [int(x) for x in args.tokens.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    pool = eo.essay_token_pool(tokenizer, max(lengths) + 8 * 997 + 8)
    results = []
    for length in lengths:
        for batch in batches:
            ids = eo.prompts(pool, batch, length, 997)
            states, held = {}, {}
            with torch.inference_mode():
                # one shared prompt forward fills all three caches (the full cache leads): the prefill is not
                # what is measured, and three separate 8k × 8 prefills would cost ~15 min on one thread
                caches = {"full": KVCache(model, "full"), "snapkv": eo.make_cache(model, "snapkv", args.budget),
                          "dbtrimkv": eo.make_cache(model, "dbtrimkv", args.budget)}
                started = time.perf_counter()
                out = prefill_shared(model, ids, list(caches.values()), logits_to_keep=1)
                for cache in caches.values():
                    cache.flush()
                prefill_s = time.perf_counter() - started
                token = out.logits[:, -1:].argmax(-1)
                for policy, cache in caches.items():
                    states[policy] = eo.DecodeState(model, cache, token)
                    held[policy] = eo.entries_per_head(cache)
                del out
                load_before = eo.load_average()
                samples = eo.interleaved_decode(states, args.rounds, args.steps)
            med = {p: statistics.median(v) for p, v in samples.items()}
            row = {
                "tokens": length, "batch": batch, "budget": args.budget,
                "median_step_s": med, "tokens_per_s": {p: batch / s for p, s in med.items()},
                "ratio_dbtrimkv_over_snapkv": med["dbtrimkv"] / med["snapkv"],
                "ratio_full_over_dbtrimkv": med["full"] / med["dbtrimkv"],
                "entries_per_head": held, "shared_prefill_s": prefill_s,
                "spread": {p: eo.spread(v) for p, v in samples.items()},
                "load_before": load_before, "load_after": eo.load_average(),
            }
            results.append(row)
            print(json.dumps({k: row[k] for k in ("tokens", "batch", "median_step_s", "ratio_dbtrimkv_over_snapkv",
                                                  "ratio_full_over_dbtrimkv")}), flush=True)
    out = {
        "benchmark": "trimkv_decode", "cpu": cpu, "dtype": str(dtype), "dtype_note": dtype_note,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "kvsieve": eo.kvsieve_source(), "settings": vars(args), "results": results,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
