"""Prefill cost of the scoring methods against SnapKV's: statistics fused into the attention pass (issue 22).

For each prompt length (default 4096 and 8192, batch 1) every policy's prefill + compression
(``KVCache(model, policy, budget=B)``, ``logits_to_keep=1``, then ``flush``) is timed ``--repeats`` times,
policies rotating, after an untimed warm-up of each; medians. ``h2o`` and ``ems`` are also run with the fusion
switched on (``<policy>_fused``, ``fuse_statistics=True``: output and column sums from one pass — on a CPU with
AMX tiles and a bf16 model kvsieve's own kernel, ``native/fused_attention.c``; the default is SDPA, then the column
sums in a second pass), so one run shows what the one-pass kernel saves.

Goals (issue 22): prefill of ``h2o``, ``ems``, ``h2o_caote``, ``tova`` ≤ 1.15× ``snapkv``; ``restkv`` ≤ 1.05×.
The JSON records the device (CPU model and bf16 support, or the GPU), dtype, threads, versions and the
kvsieve commit, medians, ratios and raw samples.

Usage: ``python benchmarks/statistics_prefill.py [--tokens 4096,8192] [--budget 256] [--repeats 5]
[--device cpu|cuda] [--dtype bfloat16|float32] [--threads N] [--model smollm2|random-smollm2|random-llama8b]
[--device-block-mib M] [--quick] [--output benchmarks/results/statistics_prefill.json]``. ``--device-block-mib``
sets the float32 logits one block of the statistics pass holds off the CPU (``kernel.DEVICE_BLOCK_BYTES``; 0: the
256-query blocks used before), to compare block sizes on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_overhead import load_average, prompts, spread
from quantize_decode import prefill, setup_run

from kvsieve.attention import kernel

RESULTS = Path(__file__).parent / "results" / "statistics_prefill.json"
POLICIES = ("snapkv", "h2o", "h2o_fused", "ems", "ems_fused", "h2o_caote", "h2o_caote_fused", "tova", "restkv")
GOALS = {"h2o_fused": 1.15, "ems_fused": 1.15, "h2o_caote_fused": 1.15, "h2o": 1.15, "ems": 1.15, "h2o_caote": 1.15,
         "tova": 1.15, "restkv": 1.05}


def timed_prefill(model: torch.nn.Module, name: str, budget: int, ids: torch.Tensor) -> float:
    """Seconds of one prefill + compression; ``<policy>_fused`` runs ``policy`` with ``fuse_statistics=True``."""
    policy = name.removesuffix("_fused")
    params: dict[str, Any] = {"budget": budget}
    if name != policy:
        params["fuse_statistics"] = True
    return prefill(model, policy, params, ids)[2]


def measure(model: torch.nn.Module, pool: torch.Tensor, tokens: int, args: argparse.Namespace,
            device: torch.device) -> dict[str, Any]:
    ids = prompts(pool, 1, tokens, tokens).to(device)
    names = list(args.policies.split(","))
    for name in names:  # warm every path
        timed_prefill(model, name, args.budget, ids[:, : min(tokens, 2 * args.budget)])
    times: dict[str, list[float]] = {name: [] for name in names}
    load_before = load_average()
    for rep in range(args.repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed_prefill(model, name, args.budget, ids))
    medians = {name: statistics.median(v) for name, v in times.items()}
    ratios = {f"{name}_over_snapkv": medians[name] / medians["snapkv"] for name in names if name != "snapkv"}
    print(f"  T={tokens}: " + ", ".join(f"{k} {v:.3f} s" for k, v in medians.items()), flush=True)
    print("    " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), flush=True)
    return {"tokens": tokens, "batch": 1, "budget": args.budget, "median_s": medians, "ratios": ratios,
            "samples_s": times, "spread_s": {n: spread(v) for n, v in times.items()},
            "load_average_before_after": [load_before, load_average()]}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", default="4096,8192")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "random-smollm2", "random-llama8b"])
    parser.add_argument("--device-block-mib", type=int, default=None,
                        help="off the CPU: MiB of float32 logits per block of the statistics pass (0: 256 queries)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1024 tokens, budget 128, 1 repeat")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.budget, args.repeats = "1024", 128, 1
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.device_block_mib is not None:
        kernel.DEVICE_BLOCK_BYTES = args.device_block_mib * 2**20
    lengths = [int(t) for t in args.tokens.split(",")]
    started = time.perf_counter()
    model, pool, device, meta = setup_run(args, "statistics_prefill", max(lengths), argv)
    rows = []
    with torch.no_grad():
        model(pool[:16].unsqueeze(0).to(device), use_cache=False)
        for tokens in lengths:
            rows.append(measure(model, pool, tokens, args, device))
    goals = [{"name": f"prefill {policy}/snapkv T={row['tokens']}", "ratio": row["ratios"][f"{policy}_over_snapkv"],
              "goal": goal, "pass": row["ratios"][f"{policy}_over_snapkv"] <= goal}
             for row in rows for policy, goal in GOALS.items() if f"{policy}_over_snapkv" in row["ratios"]]
    result = {**meta, "settings": {k: v for k, v in vars(args).items() if k != "output"}, "prefill": rows,
              "goals": goals, "all_pass": all(g["pass"] for g in goals), "load_average_at_end": load_average(),
              "wall_s": time.perf_counter() - started}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps([f"{g['name']}: {g['ratio']:.3f} (goal <= {g['goal']}) {'PASS' if g['pass'] else 'FAIL'}"
                      for g in goals], indent=2))


if __name__ == "__main__":
    main()
