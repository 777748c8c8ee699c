"""Decode benchmark: KV bytes, prefill overhead and decoding throughput of compressed vs full caches.

A thin wrapper over :mod:`kvsieve.bench` (``kvsieve bench`` has the full grid: context lengths, batch
sizes, latency and memory). On SmolLM2-135M-Instruct with a 4k-token essay prompt, for snapkv and adakv
at 256 entries per head, measured in one run against the full cache (transformers' DynamicCache), each
run in a fresh process, full and compressed alternating, medians over repeats:

* ``kv_bytes_ratio``: key/value bytes held after prefill, compressed / full (expect 256/4096 = 1/16);
* ``prefill_ratio``: prefill + compression time / plain prefill time;
* ``decode_speedup_b1`` / ``decode_speedup_b8``: decoding tokens/s over the full cache's at batch 1 and 8
  (batch 8 replicates the prefilled batch-1 cache: eight identical prompts).

Writes ``benchmarks/results/decode.json`` (these fields, plus the whole ``kvsieve bench`` result under
``bench``). Usage: ``python benchmarks/decode.py [--tokens 4096] [--dtype float32] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from kvsieve.bench import BenchConfig, run_bench

RESULTS = Path(__file__).parent / "results" / "decode.json"


def legacy_fields(result: dict[str, Any], config: BenchConfig) -> dict[str, Any]:
    """The fields this script has always written, from a :func:`kvsieve.bench.run_bench` result."""
    rows = result["summary"]
    meta = result["meta"]
    out: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct" if config.model == "smollm2" else config.model,
        "dtype": config.dtype, "prompt_tokens": config.lengths[0], "budget": config.budget,
        "decode_steps": config.steps, "torch": meta["torch"], "threads": config.threads,
        "python": meta["python"], "policies": {},
    }
    first = min(config.batches)
    full = {r["batch"]: r for r in rows if r["label"] == "full"}
    out["full_prefill_s"] = full[first]["prefill_s"]
    for batch, row in sorted(full.items()):
        out[f"full_decode_tokens_per_s_b{batch}"] = row["decode_tokens_per_s"]
    for row in rows:
        if row["label"] == "full":
            continue
        entry = out["policies"].setdefault(row["label"], {})
        if row["batch"] == first:
            entry.update({
                "kv_bytes": row["prefill_kv_bytes"], "full_kv_bytes": full[first]["prefill_kv_bytes"],
                "kv_bytes_ratio": row["prefill_kv_bytes_ratio"], "prefill_s": row["prefill_s"],
                "prefill_ratio": row["prefill_s_ratio"],
            })
        entry[f"decode_tokens_per_s_b{row['batch']}"] = row["decode_tokens_per_s"]
        entry[f"decode_speedup_b{row['batch']}"] = row["decode_tokens_per_s_ratio"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--policies", default="snapkv,adakv")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="float32 is ~3.5x faster on CPUs without native bf16")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quick", action="store_true", help="512-token prompt, 4 steps, 1 repeat, budget 64")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = BenchConfig(
        model=args.model, dtype=args.dtype, threads=args.threads, policies=args.policies.split(","),
        budget=args.budget, lengths=[args.tokens], batches=[int(b) for b in args.batches.split(",")],
        steps=args.steps, repeats=args.repeats,
    )
    if args.quick:
        config = BenchConfig(model=args.model, dtype=args.dtype, threads=args.threads, policies=config.policies,
                             budget=64, lengths=[512], batches=config.batches, steps=4, warmup=1, repeats=1)
    result = run_bench(config, output=None)
    legacy = legacy_fields(result, config)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({**legacy, "bench": result}, indent=2) + "\n")
    print(json.dumps(legacy["policies"], indent=2))


if __name__ == "__main__":
    main()
