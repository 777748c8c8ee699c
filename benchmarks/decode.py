"""Decode benchmark: KV bytes, prefill overhead and decoding throughput of compressed vs full caches.

On SmolLM2-135M-Instruct (bf16) with a 4k-token essay prompt, for snapkv and adakv at 256 entries per
head, measured in one run against the full cache (transformers' DynamicCache through the same
attention function, which defers to SDPA):

* ``kv_bytes_ratio``: key/value bytes held after prefill, compressed / full (expect 256/4096 = 1/16);
* ``prefill_ratio``: prefill + compression time / plain prefill time (median of alternating repeats);
* ``decode_speedup_b1`` / ``decode_speedup_b8``: decoding tokens/s over the full cache's at batch 1 and 8
  (batch 8 replicates the prefilled batch-1 caches: eight identical prompts).

Writes ``benchmarks/results/decode.json``. Usage: ``python benchmarks/decode.py [--tokens 4096] [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvsieve import KVCache, load_default_model
from kvsieve.eval.haystack import load_essays

RESULTS = Path(__file__).parent / "results" / "decode.json"


def prompt_ids(tokenizer, tokens: int, batch: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ids = tokenizer(load_essays(), add_special_tokens=False)["input_ids"][:tokens]
    return torch.tensor([ids] * batch)


def full_kv_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def make_cache(model, name: str, budget: int):  # type: ignore[no-untyped-def]
    return DynamicCache(config=model.config) if name == "full" else KVCache(model, name, budget=budget)


def timed_prefill(model, ids: torch.Tensor, cache) -> tuple[float, torch.Tensor]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start, out.logits[:, -1:].argmax(-1)


def decode_tokens_per_s(model, cache, token: torch.Tensor, steps: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for _ in range(steps):
        token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return steps * token.shape[0] / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_default_model(dtype=torch.bfloat16)
    policies = ["snapkv", "adakv"]
    result: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "prompt_tokens": args.tokens,
        "budget": args.budget, "decode_steps": args.steps, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "python": platform.python_version(), "policies": {},
    }
    with torch.inference_mode():
        ids = prompt_ids(tokenizer, args.tokens, 1)
        # Prefill: alternate full / compressed runs so drift hits both alike; report medians.
        times: dict[str, list[float]] = {name: [] for name in ["full", *policies]}
        held: dict[str, int] = {}
        last: dict[str, object] = {}
        first_token: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for name in times:
                cache = make_cache(model, name, args.budget)
                elapsed, first_token[name] = timed_prefill(model, ids, cache)
                times[name].append(elapsed)
                held[name] = full_kv_bytes(cache) if name == "full" else cache.kv_nbytes()
                last[name] = cache
            print(f"prefill s: { {k: round(v[-1], 2) for k, v in times.items()} }", flush=True)
        full_prefill = statistics.median(times["full"])
        result["full_prefill_s"] = full_prefill
        for name in policies:
            result["policies"][name] = {  # type: ignore[index]
                "kv_bytes": held[name], "full_kv_bytes": held["full"],
                "kv_bytes_ratio": held[name] / held["full"],
                "prefill_s": statistics.median(times[name]),
                "prefill_ratio": statistics.median(times[name]) / full_prefill,
            }
        # Decoding: the caches of the last prefill repeat, replicated to each batch size (identical prompts;
        # replicating a prefilled cache is what a batch of identical prompts would hold, without paying
        # batch × 4k tokens of bf16 prefill on a 2-core CPU).
        for batch in [int(b) for b in args.batches.split(",")]:
            speed: dict[str, float] = {}
            for name in ["full", *policies]:
                cache = copy.deepcopy(last[name])
                if batch > 1:
                    cache.batch_repeat_interleave(batch)
                token = first_token[name].repeat(batch, 1)
                decode_tokens_per_s(model, cache, token, 2)  # warm-up
                speed[name] = decode_tokens_per_s(model, cache, token, args.steps)
            result[f"full_decode_tokens_per_s_b{batch}"] = speed["full"]
            for name in policies:
                entry = result["policies"][name]  # type: ignore[index]
                entry[f"decode_tokens_per_s_b{batch}"] = speed[name]
                entry[f"decode_speedup_b{batch}"] = speed[name] / speed["full"]
            print(f"batch {batch}: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in speed.items()), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["policies"], indent=2))


if __name__ == "__main__":
    main()
