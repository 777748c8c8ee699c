"""Argument parsing and entry point of ``kvsieve bench``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from kvsieve.bench.runner import BenchConfig, run_bench
from kvsieve.models.arguments import add_model_arguments


def _list(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}") from None

    return parse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvsieve bench`` (given flags override ``--quick``'s values)."""
    defaults = BenchConfig()
    parser.add_argument("--quick", action="store_true",
                        help="smoke configuration: contexts 256,512, batches 1,4, 4 steps, 1 repeat, budget 64")
    parser.add_argument("--policies", type=_list(str), help=f"compressed caches (default {defaults.policies}); "
                        "parameters after colons, e.g. h2o:schedule=decode")
    parser.add_argument("--budget", type=int, help=f"entries per KV head (default {defaults.budget})")
    parser.add_argument("--lengths", type=_list(int), help=f"context lengths (default {defaults.lengths})")
    parser.add_argument("--batches", type=_list(int), help=f"batch sizes (default {defaults.batches})")
    parser.add_argument("--steps", type=int, help=f"timed decoding steps (default {defaults.steps})")
    parser.add_argument("--warmup", type=int, help=f"untimed decoding steps first (default {defaults.warmup})")
    parser.add_argument("--repeats", type=int, help=f"alternating repeats; medians (default {defaults.repeats})")
    add_model_arguments(parser, with_defaults=False, with_tokenizer=False)
    parser.add_argument("--threads", type=int, help=f"torch threads per run (default {defaults.threads})")
    parser.add_argument("--isolate-batches", action="store_true", default=None,
                        help="one fresh process per batch size too (prefill repeated per batch)")
    parser.add_argument("--output", default="results/bench/bench.json",
                        help="JSON result; the figure goes beside it as .png/.svg")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Defaults, then ``--quick``, then every flag given."""
    config = BenchConfig().quick() if args.quick else BenchConfig()
    given = {name: getattr(args, name) for name in ("policies", "budget", "lengths", "batches", "steps", "warmup",
                                                     "repeats", "model", "dtype", "device", "threads",
                                                     "isolate_batches")}
    return replace(config, **{k: v for k, v in given.items() if v is not None})


def format_summary(result: dict[str, Any]) -> str:
    """A plain table of the summary: figures and ratios to the full cache."""
    head = (f"{'length':>6} {'batch':>5} {'cache':<16} {'prefill s':>9} {'tok/s':>8} {'ms/tok':>7} "
            f"{'KV MiB':>8} {'peak MiB':>9} {'speed-up':>8} {'KV ratio':>8}")
    lines = [head, "-" * len(head)]
    for r in result["summary"]:
        ratio = r.get("decode_tokens_per_s_ratio")
        kv_ratio = r.get("kv_bytes_ratio")
        lines.append(
            f"{r['length']:>6} {r['batch']:>5} {r['label'][:16]:<16} {r['prefill_s']:>9.2f} "
            f"{r['decode_tokens_per_s']:>8.1f} {r['latency_ms_median']:>7.1f} {r['kv_bytes'] / 2**20:>8.1f} "
            f"{r['decode_peak_rss_bytes'] / 2**20:>9.0f} {'' if ratio is None else f'{ratio:.2f}x':>8} "
            f"{'' if kv_ratio is None else f'{kv_ratio:.3f}':>8}"
        )
    return "\n".join(lines)


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the benchmark grid, print a table, write JSON and the figure."""
    config = config_from_args(args)
    result = run_bench(config, output=args.output, progress=not args.no_progress, plot=not args.no_plot)
    print(format_summary(result))
    print(f"kvsieve bench: wrote {args.output}", file=sys.stderr)
    if result["failed"]:
        print(f"kvsieve bench: {len(result['failed'])} configuration(s) failed (listed under 'failed' in "
              f"{args.output}); the others are kept", file=sys.stderr)
        return 1
    return 0
