"""Mixed-precision speed: is a quantized cache's decoding step as cheap as an evict-only cache of the same bytes?

Issue 21, item 5. For each prompt length ``T`` (default 4096 and 8192) and batch size (default 1 and 8; batch
8 = eight *different* essay prompts, no padding) four caches are filled once from the same prompts:

* ``mixed``: ``KVCache(model, "mixed", budget=B)`` — half of ``B`` full entries' bytes per head keeps the
  best restkv entries in the model dtype, half buys 2-bit entries (groups of 32);
* ``evict_same_bytes``: ``restkv`` at ``budget=B`` (the bytes ``mixed`` holds, or a little more);
* ``evict_same_entries``: ``restkv`` at the number of entries ``mixed`` holds per head (4–8× the bytes);
* ``kivi``: every entry but a ``B``-entry full-precision residual at 2 bits, nothing evicted.

Then ``--rounds`` rounds, each from fresh deep copies of the filled caches, time ``--steps`` single-token
decoding forwards of every cache, interleaved step by step (order rotated every step), greedy token fed
back; medians compared. On CUDA every timed step is bracketed by ``torch.cuda.synchronize()``.

Also measured:

* **where the time goes**: the seconds per step of rebuilding every layer's combined view (dequantize the
  2-bit groups, merge them with the full-precision entries in position order) — the work a fused kernel
  reading packed codes inside attention would not do; and the bytes that view moves per step against the
  packed bytes held;
* **prefill**: ``mixed`` vs ``restkv`` prefill + compression at batch 1 (same scorer, so the difference is
  the quantization), rotating, ``--prefill-repeats`` times. Goal: ≤ 1.05.

Goals (issue 21): decoding step ``mixed / evict_same_bytes`` ≤ 1.15 at every length and batch; prefill
``mixed / restkv`` ≤ 1.05. The JSON records the device (CPU model and bf16 support, or the GPU), dtype,
threads, versions, the kvsieve commit, medians, ratios, raw samples and spreads.

``--model random-smollm2`` / ``random-llama8b`` build the default model's architecture (or Llama-3.1-8B's:
32 layers, 32 query / 8 KV heads of 128) with random weights from the config, on the chosen device, for a
machine without the default model's files: the decoding cost of a cache depends on the entries it holds and
the model's shapes, not on the weights (the kept entries differ, their number does not). Token ids are then
random too.

Usage: ``python benchmarks/quantize_decode.py [--tokens 4096,8192] [--batches 1,8] [--budget 128]
[--rounds 5] [--steps 8] [--device cpu|cuda] [--dtype bfloat16|float32] [--threads N]
[--model smollm2|random-smollm2|random-llama8b] [--quick] [--output benchmarks/results/quantize_decode.json]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_overhead import (
    cpu_info,
    essay_token_pool,
    kvsieve_source,
    load_average,
    pick_dtype,
    prompts,
    spread,
)

from kvsieve.transformers_adapter import cache_kwargs

RESULTS = Path(__file__).parent / "results" / "quantize_decode.json"
GOAL_DECODE = 1.15
GOAL_PREFILL = 1.05
MIXED, SAME_BYTES, SAME_ENTRIES, KIVI = "mixed", "evict_same_bytes", "evict_same_entries", "kivi"


# ---------------------------------------------------------------------------------------------- models
def random_model(kind: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The default model's architecture or Llama-3.1-8B's, random weights (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind == "random-smollm2":
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    elif kind == "random-llama8b":
        config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                             rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
    else:
        raise ValueError(f"--model must be smollm2, random-smollm2 or random-llama8b; got {kind!r}")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the model dtype: an 8B model is never held in float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def load(kind: str, dtype: torch.dtype, device: torch.device, tokens: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model and a 1-D pool of at least ``tokens`` token ids (essays, or random ids for random models)."""
    if kind == "smollm2":
        from kvsieve import load_default_model

        model, tokenizer = load_default_model(dtype=dtype)
        return model.to(device), essay_token_pool(tokenizer, tokens)
    model = random_model(kind, dtype, device)
    generator = torch.Generator().manual_seed(0)
    return model, torch.randint(100, model.config.vocab_size, (tokens,), generator=generator)


# ---------------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model: torch.nn.Module, policy: str, params: dict[str, Any], ids: torch.Tensor) -> tuple[Any, Any, float]:
    """A filled ``KVCache``, the greedy next token and the seconds of prefill + compression."""
    from kvsieve import KVCache

    cache = KVCache(model, policy, **params)
    synchronize(ids.device)
    started = time.perf_counter()
    out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    cache.flush()
    synchronize(ids.device)
    return cache, out.logits[:, -1:].argmax(-1), time.perf_counter() - started


def step(model: torch.nn.Module, cache: Any, token: torch.Tensor) -> torch.Tensor:
    out = model(token, **cache_kwargs(model, cache), attention_mask=None, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


def interleaved(model: torch.nn.Module, states: dict[str, tuple[Any, torch.Tensor]], rounds: int, steps: int,
                warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per decoding step of each filled cache, interleaved step by step, fresh copies every round."""
    names = list(states)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        work = {name: copy.deepcopy(cache) for name, (cache, _) in states.items()}
        tokens = {name: token.clone() for name, (_, token) in states.items()}
        for name in names:
            for _ in range(warmup):
                tokens[name] = step(model, work[name], tokens[name])
        for s in range(steps):
            shift = (r * steps + s) % len(names)
            for name in names[shift:] + names[:shift]:
                synchronize(device)
                started = time.perf_counter()
                tokens[name] = step(model, work[name], tokens[name])
                synchronize(device)
                times[name].append(time.perf_counter() - started)
        del work
    return times


def view_rebuild(cache: Any, device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Seconds per step spent reading the quantized entries: every layer's attention view (dequantize the
    tiers, concatenate them with the full-precision entries — what each decoding step does), the
    dequantization alone, and the position-ordered view that scorers read at a compaction; and the bytes the
    attention views hold next to the packed bytes they come from."""
    stores = [layer.store for layer in cache.layers if getattr(layer, "store", None) is not None]
    stores = [store for store in stores if store.tiered]
    if not stores:
        return {}

    def timed(work: Callable[[], None]) -> float:
        samples = []
        for _ in range(repeats):
            synchronize(device)
            started = time.perf_counter()
            work()
            synchronize(device)
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    def ordered() -> None:
        for store in stores:
            store._combined = None
            store.dense()

    attention = timed(lambda: [store.attention_view() for store in stores] and None)
    dequant = timed(lambda: [tier.dequantized() for store in stores for tier in store.tiers] and None)
    views = [store.attention_view() for store in stores]
    view_bytes = sum(2 * view.keys.numel() * view.keys.element_size() for view in views)
    return {"attention_view_s": attention, "dequantize_s": dequant, "ordered_view_s": timed(ordered),
            "layers": len(stores), "attention_view_bytes": view_bytes, "kv_bytes_held": cache.kv_nbytes()}


def entries(cache: Any) -> dict[str, float]:
    lengths = cache.head_lengths().float()
    return {"mean": float(lengths.mean()), "min": float(lengths.min()), "max": float(lengths.max()),
            "kv_bytes": cache.kv_nbytes()}


# ---------------------------------------------------------------------------------------------- phases
def measure_decode(model: torch.nn.Module, pool: torch.Tensor, tokens: int, batch: int, args: argparse.Namespace,
                   device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    ids = prompts(pool, batch, tokens, tokens).to(device)
    budget = args.budget
    states: dict[str, tuple[Any, torch.Tensor]] = {}
    info: dict[str, Any] = {}
    build: dict[str, float] = {}
    cache, token, build[MIXED] = prefill(model, "mixed", {"budget": budget}, ids)
    states[MIXED] = (cache, token)
    info[MIXED] = entries(cache)
    held = round(info[MIXED]["mean"])
    plan = {SAME_BYTES: ("restkv", {"budget": budget}), SAME_ENTRIES: ("restkv", {"budget": held}),
            KIVI: ("kivi", {"budget": budget})}
    for name, (policy, params) in plan.items():
        cache, token, build[name] = prefill(model, policy, params, ids)
        states[name] = (cache, token)
        info[name] = entries(cache)
    for name in states:
        log(f"  T={tokens} b{batch} {name}: prefill {build[name]:.2f} s, entries/head {info[name]}")
    rebuild = view_rebuild(states[MIXED][0], device)
    rebuild_kivi = view_rebuild(states[KIVI][0], device)
    load_before = load_average()
    times = interleaved(model, states, args.rounds, args.steps, args.warmup, device)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {f"{MIXED}_over_{SAME_BYTES}": medians[MIXED] / medians[SAME_BYTES],
              f"{MIXED}_over_{SAME_ENTRIES}": medians[MIXED] / medians[SAME_ENTRIES],
              f"{KIVI}_over_{SAME_BYTES}": medians[KIVI] / medians[SAME_BYTES]}
    if rebuild:
        rebuild["share_of_mixed_step"] = rebuild["attention_view_s"] / medians[MIXED]
    if rebuild_kivi:
        rebuild_kivi["share_of_kivi_step"] = rebuild_kivi["attention_view_s"] / medians[KIVI]
    log(f"  T={tokens} b{batch} ms/step: " + ", ".join(f"{k} {1000 * v:.2f}" for k, v in medians.items())
        + " | " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
        + f" | attention view mixed {rebuild.get('share_of_mixed_step', 0):.2f}, "
          f"kivi {rebuild_kivi.get('share_of_kivi_step', 0):.2f} of the step")
    return {"tokens": tokens, "batch": batch, "budget": budget, "median_s": medians, "ratios": ratios,
            "entries_per_head": info, "build_prefill_s": build, "view_rebuild_mixed": rebuild,
            "view_rebuild_kivi": rebuild_kivi, "samples_per_config": len(times[MIXED]),
            "spread_s": {n: spread(v) for n, v in times.items()},
            "load_average_before_after": [load_before, load_average()],
            "samples_ms": {n: [round(1000 * x, 4) for x in v] for n, v in times.items()}}


def measure_prefill(model: torch.nn.Module, pool: torch.Tensor, tokens: int, args: argparse.Namespace,
                    device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    ids = prompts(pool, 1, tokens, tokens).to(device)
    names = {"restkv": ("restkv", {"budget": args.budget}), MIXED: ("mixed", {"budget": args.budget})}
    for policy, params in names.values():  # warm every path
        prefill(model, policy, params, ids[:, : min(tokens, 4 * args.budget)])
    times: dict[str, list[float]] = {name: [] for name in names}
    order = list(names)
    for rep in range(args.prefill_repeats):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            policy, params = names[name]
            times[name].append(prefill(model, policy, params, ids)[2])
    medians = {name: statistics.median(v) for name, v in times.items()}
    ratio = medians[MIXED] / medians["restkv"]
    log(f"  prefill T={tokens}: " + ", ".join(f"{k} {v:.3f} s" for k, v in medians.items()) + f" | {ratio:.3f}")
    return {"tokens": tokens, "batch": 1, "median_s": medians, "mixed_over_restkv": ratio, "samples_s": times,
            "spread_s": {n: spread(v) for n, v in times.items()}}


def goals(decode: list[dict[str, Any]], prefill_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [{"name": f"decode mixed/evict_same_bytes T={row['tokens']} b{row['batch']}",
            "ratio": row["ratios"][f"{MIXED}_over_{SAME_BYTES}"], "goal": GOAL_DECODE} for row in decode]
    out += [{"name": f"prefill mixed/restkv T={row['tokens']}", "ratio": row["mixed_over_restkv"],
             "goal": GOAL_PREFILL} for row in prefill_rows]
    for goal in out:
        goal["pass"] = goal["ratio"] <= goal["goal"]
    return out


def device_info(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "cuda": torch.version.cuda}
    from kvsieve.native import build, column_sums, evict_lowest, fused_attention, restkv_scores, tiered_attention
    from kvsieve.native.dequantize import available

    # which of kvsieve's C helpers run here (KVSIEVE_NATIVE=0 or no compiler: PyTorch): the tiers' reads, the
    # attention passes (vector code), the in-place every-step eviction, a bf16 prompt's column sums (AVX512-BF16) and
    # its output with the sums from one pass (AMX tiles for bf16, AVX-512 or AVX2 for float32: fuse_statistics=True),
    # and ReST-KV's window scores (AVX-512 or AVX2)
    return {"type": "cpu", **cpu_info(), "native_dequantize": available(),
            "native_tiered_attention": tiered_attention._kernel() is not None,
            "native_vector_code": build.vector_code(), "native_evict_lowest": evict_lowest.available(),
            "native_column_sums": column_sums.bf16_dot(), "native_fused_attention": fused_attention.tiles(),
            "native_fused_attention_float32": fused_attention.vector_code(),
            "native_restkv_scores": restkv_scores.vector_code()}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", default="4096,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--budget", type=int, default=128, help="bytes per head, in full-precision entries")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "random-smollm2", "random-llama8b"])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1024 tokens, budget 128, batches 1,2, 1 round of 2 steps")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.batches, args.budget = "1024", "1,2", 128
        args.rounds, args.steps, args.prefill_repeats = 1, 2, 1
    return args


def setup_run(args: argparse.Namespace, benchmark: str, tokens_needed: int, argv: Sequence[str] | None
              ) -> tuple[torch.nn.Module, torch.Tensor, torch.device, dict[str, Any]]:
    """Threads, device and dtype from ``args`` (``--threads``, ``--device``, ``--dtype``, ``--model``), the model
    and a token pool of ``tokens_needed`` ids, and the run's metadata (printed): what every JSON here records."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import transformers

    device = torch.device(args.device)
    if device.type == "cuda":
        dtype, note = {"float32": torch.float32}.get(args.dtype or "", torch.bfloat16), "GPU"
    else:
        dtype, note = pick_dtype(args.dtype, cpu_info()["bf16_native"])
    model, pool = load(args.model, dtype, device, tokens_needed)
    meta = {"benchmark": benchmark, "model": args.model, "dtype": str(dtype).removeprefix("torch."),
            "dtype_note": note, "device": device_info(device), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "kvsieve": kvsieve_source(),
            "load_average_at_start": load_average(),
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}
    print(json.dumps(meta, indent=2), flush=True)
    return model, pool, device, meta


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    lengths = [int(t) for t in args.tokens.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    started = time.perf_counter()
    model, pool, device, meta = setup_run(args, "quantize_decode", max(lengths) * max(batches), argv)

    def log(line: str) -> None:
        print(line, flush=True)

    decode, prefill_rows = [], []
    with torch.no_grad():
        model(pool[:16].unsqueeze(0).to(device), use_cache=False)
        for tokens in lengths:
            for batch in batches:
                decode.append(measure_decode(model, pool, tokens, batch, args, device, log))
            prefill_rows.append(measure_prefill(model, pool, tokens, args, device, log))
    result = {**meta, "settings": {k: v for k, v in vars(args).items() if k != "output"}, "decode": decode,
              "prefill": prefill_rows, "goals": goals(decode, prefill_rows),
              "load_average_at_end": load_average(), "wall_s": time.perf_counter() - started}
    result["all_pass"] = all(goal["pass"] for goal in result["goals"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps([f"{g['name']}: {g['ratio']:.3f} (goal <= {g['goal']}) {'PASS' if g['pass'] else 'FAIL'}"
                      for g in result["goals"]], indent=2))


if __name__ == "__main__":
    main()
