"""Sparse-attention decoding benchmark (issue 11): step time and KV bytes read against the full cache.

At ``--tokens`` context (default 8128: with the decoding steps, within the model's 8192 positions) and
token budget ``--budget`` (default 256), on the default model, one thread: for each selector
(``exact_topk``, ``quest``, ``sparq``, ``hsa``) and for ``rocketkv``, ``rocketkv_mt`` (and ``snapkv`` at the
same budget, an evicting reference), a decoding step is timed *interleaved step by step* with a full cache
holding the same context (order alternating), so every ratio comes from one run. Batch 1 is filled by one
shared prefill of an essay prompt; batch ``B`` repeats that batch-1 state ``B`` times
(``batch_repeat_interleave``: the per-step work is what ``B`` different rows cost; an 8×8k prefill would take
most of an hour on one thread).

Reported per (batch, policy): median seconds per step of the policy and of the full cache, their ratio,
KV bytes read per decoding step (measured by each selector's ``SelectionState``: keys, values, page
min/max and mean values actually read; the full cache reads every held key and value) and that ratio,
and the storage (``KVCache.storage()``) against the full cache's. The machine (CPU, bf16 support),
dtype, threads, versions and load averages are recorded (helpers of ``engine_overhead.py``).

Usage: ``python benchmarks/sparse_decode.py [--tokens 8192] [--budget 256] [--batches 1,8] [--steps 12]
[--warmup 2] [--policies ...] [--dtype float32] [--output benchmarks/results/sparse_decode.json]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_overhead import cpu_info, essay_token_pool, kvsieve_source, load_average, pick_dtype

from kvsieve.transformers_adapter import cache_kwargs

RESULTS = Path(__file__).parent / "results" / "sparse_decode.json"
POLICIES = ("exact_topk", "quest", "sparq", "hsa", "rocketkv", "rocketkv_mt", "snapkv")


def _step(model: torch.nn.Module, cache: Any, token: torch.Tensor) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = model(token, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    elapsed = time.perf_counter() - start
    return elapsed, out.logits[:, -1].argmax(dim=-1, keepdim=True)


def measure_pair(model: torch.nn.Module, full: Any, cache: Any, token: torch.Tensor, steps: int,
                 warmup: int) -> dict[str, Any]:
    """Interleave ``steps`` decoding steps of ``full`` and ``cache`` (order alternating); medians and traffic."""
    tokens = {"full": token, "policy": token}
    caches = {"full": full, "policy": cache}
    samples: dict[str, list[float]] = {"full": [], "policy": []}
    traffic_before = cache.traffic()
    for i in range(warmup + steps):
        order = ("full", "policy") if i % 2 == 0 else ("policy", "full")
        for name in order:
            elapsed, tokens[name] = _step(model, caches[name], tokens[name])
            if i >= warmup:
                samples[name].append(elapsed)
        if i == warmup - 1:
            traffic_before = cache.traffic()
    after = cache.traffic()
    steps_measured = after["steps"] - traffic_before["steps"]
    read = after["read_bytes"] - traffic_before["read_bytes"]
    full_read = after["full_bytes"] - traffic_before["full_bytes"]
    layers = len(cache.layers)
    med_full, med_policy = statistics.median(samples["full"]), statistics.median(samples["policy"])
    result: dict[str, Any] = {
        "step_s_policy": med_policy, "step_s_full": med_full, "time_ratio": med_policy / med_full,
        "samples_policy": samples["policy"], "samples_full": samples["full"],
    }
    if steps_measured:
        per_step = layers / steps_measured
        result.update({
            "read_bytes_per_step": read * per_step, "full_read_bytes_per_step": full_read * per_step,
            "read_ratio": read / full_read if full_read else None,
        })
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8128)  # + decoding steps within 8192 positions
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")

    import kvsieve
    from kvsieve.engine.shared_prefill import prefill_shared

    cpu = cpu_info()
    dtype, dtype_note = pick_dtype(args.dtype, cpu["bf16_native"])
    model, tokenizer = kvsieve.load_default_model(dtype=dtype)
    policies = tuple(args.policies.split(","))
    ids = essay_token_pool(tokenizer, args.tokens)[None, :]
    load_before = load_average()
    caches = {"full": kvsieve.KVCache(model, "full")}
    caches.update({name: kvsieve.KVCache(model, name, budget=args.budget) for name in policies})
    start = time.perf_counter()
    with torch.no_grad():
        out = prefill_shared(model, ids, list(caches.values()), logits_to_keep=1)
    prefill_s = time.perf_counter() - start
    first = out.logits[:, -1].argmax(dim=-1, keepdim=True)
    rows: list[dict[str, Any]] = []
    full_storage = None
    for batch in (int(b) for b in args.batches.split(",")):
        token = first.repeat(batch, 1)
        with torch.no_grad():
            for name in policies:
                full = copy.deepcopy(caches["full"])  # a fresh full cache per pair: same length as the policy's
                if batch > 1:
                    full.batch_repeat_interleave(batch)
                cache = copy.deepcopy(caches[name])
                if batch > 1:
                    cache.batch_repeat_interleave(batch)
                row = {"batch": batch, "policy": name, "budget": args.budget, "tokens": args.tokens,
                       **measure_pair(model, full, cache, token, args.steps, args.warmup)}
                storage, full_storage = cache.storage(), full.storage()
                row["storage"] = storage
                row["storage_ratio"] = (storage["kv"] + storage["aux"] + storage["side"]) / full_storage["kv"]
                # full attention reads every held key and value of the *full* cache (a policy that evicted
                # holds less: its SelectionState compares with what it holds, this compares with full)
                row["full_cache_read_bytes_per_step"] = full_storage["kv"]
                if "read_bytes_per_step" in row:
                    row["read_ratio_vs_full_cache"] = row["read_bytes_per_step"] / full_storage["kv"]
                else:  # an evicting cache without a selector reads everything it holds
                    row["read_ratio_vs_full_cache"] = storage["kv"] / full_storage["kv"]
                rows.append(row)
                print(f"batch {batch} {name:12s} time x{row['time_ratio']:.3f} "
                      f"({row['step_s_policy'] * 1e3:.1f} vs {row['step_s_full'] * 1e3:.1f} ms) "
                      f"read x{row['read_ratio_vs_full_cache']:.4f} storage x{row['storage_ratio']:.3f}",
                      flush=True)
                del cache, full
    result = {
        "benchmark": "sparse_decode", "cpu": cpu, "dtype": str(dtype), "dtype_note": dtype_note,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "kvsieve": kvsieve_source(),
        "settings": vars(args) | {"output": str(args.output)}, "prefill_s": prefill_s,
        "load_before": load_before, "load_after": load_average(), "rows": rows,
        "full_storage_batch_last": full_storage,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
