"""Block-wise prefill benchmark: peak memory of a long prompt processed in blocks vs at once, and the
prefill cost of ReST-KV relative to SnapKV.

* Peak memory: each configuration runs in a fresh subprocess (``spawn``) on the default model and
  reports its peak RSS (``ru_maxrss``) and the cache's own peak KV entries per head
  (``KVCache.peak_head_length``). Configurations: the full cache (DynamicCache), snapkv compressing after
  the whole prompt, and h2o under the ``blockwise`` schedule fed one block at a time (a hard bound of
  ``budget + block_size`` entries per head).
* Prefill cost: restkv vs snapkv prefill+compression time on the same prompt (alternating runs, medians).

Writes ``benchmarks/results/blockwise.json``. Usage:
``python benchmarks/blockwise.py [--tokens 8192] [--budget 512] [--block 128] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import time
from pathlib import Path

import torch

from kvsieve.transformers_adapter import cache_kwargs

RESULTS = Path(__file__).parent / "results" / "blockwise.json"


def _prompt(tokenizer, tokens: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from kvsieve.models.haystack import load_essays

    ids = tokenizer(load_essays(), add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < tokens:
        raise ValueError(f"--tokens: the essays hold only {len(ids)} tokens")
    return torch.tensor([ids])


def _peak_worker(mode: str, tokens: int, budget: int, block: int, threads: int, queue: mp.Queue) -> None:
    torch.set_num_threads(threads)
    from transformers import DynamicCache

    from kvsieve import KVCache, load_default_model

    model, tokenizer = load_default_model(dtype=torch.float32)
    ids = _prompt(tokenizer, tokens)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    with torch.inference_mode():
        if mode == "full":
            cache = DynamicCache(config=model.config)
            model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            peak_entries = tokens
            kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        elif mode == "snapkv_at_once":
            cache = KVCache(model, "snapkv", budget=budget)
            model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            peak_entries, kv_bytes = cache.peak_head_length(), cache.kv_nbytes()
        else:
            cache = KVCache(model, "h2o", budget=budget, schedule="blockwise", block_size=block)
            for lo in range(0, tokens, block):
                model(ids[:, lo : lo + block], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            peak_entries, kv_bytes = cache.peak_head_length(), cache.kv_nbytes()
    queue.put({
        "mode": mode,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_load_mib": base_rss / 1024,
        "peak_entries_per_head": peak_entries,
        "kv_bytes_held_after": kv_bytes,
        "elapsed_s": time.perf_counter() - started,
    })


def peak_memory(tokens: int, budget: int, block: int, threads: int) -> dict[str, dict[str, float]]:
    ctx = mp.get_context("spawn")
    out: dict[str, dict[str, float]] = {}
    for mode in ("full", "snapkv_at_once", "h2o_blockwise"):
        queue: mp.Queue = ctx.Queue()
        proc = ctx.Process(target=_peak_worker, args=(mode, tokens, budget, block, threads, queue))
        proc.start()
        out[mode] = queue.get()
        proc.join()
        print(out[mode], flush=True)
    return out


def restkv_prefill_ratio(tokens: int, budget: int, repeats: int, threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    from kvsieve import KVCache, load_default_model

    model, tokenizer = load_default_model(dtype=torch.float32)
    ids = _prompt(tokenizer, tokens)
    times: dict[str, list[float]] = {"snapkv": [], "restkv": []}
    with torch.inference_mode():
        for _ in range(repeats):
            for name in times:
                cache = KVCache(model, name, budget=budget)
                started = time.perf_counter()
                model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
                times[name].append(time.perf_counter() - started)
    snap, rest = statistics.median(times["snapkv"]), statistics.median(times["restkv"])
    return {"snapkv_prefill_s": snap, "restkv_prefill_s": rest, "restkv_over_snapkv": rest / snap,
            "prompt_tokens": tokens, "budget": budget, "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    peaks = peak_memory(args.tokens, args.budget, args.block, args.threads)
    full = peaks["full"]
    result = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "prompt_tokens": args.tokens,
        "budget": args.budget, "block_size": args.block, "threads": args.threads, "torch": torch.__version__,
        "peak_memory": peaks,
        "peak_rss_ratio_blockwise_over_full": peaks["h2o_blockwise"]["peak_rss_mib"] / full["peak_rss_mib"],
        "peak_rss_ratio_snapkv_at_once_over_full": peaks["snapkv_at_once"]["peak_rss_mib"] / full["peak_rss_mib"],
        "peak_kv_entries_ratio_blockwise_over_full": peaks["h2o_blockwise"]["peak_entries_per_head"] / args.tokens,
        "prefill": restkv_prefill_ratio(args.prefill_tokens, 256, args.repeats, args.threads),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "peak_memory"}, indent=2))


if __name__ == "__main__":
    main()
