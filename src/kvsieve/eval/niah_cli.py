"""``kvsieve niah``: the passkey comparison (full cache, baselines, the papers' methods) over a range of
budgets, as a table, a JSON file and a plot of exact match and answer log-likelihood vs budget."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvsieve.policies.presets import make_policy
from kvsieve.policies.spec import parse_policy_spec
from kvsieve.result_files import check_output_file, write_json_atomic
from kvsieve.transformers_adapter import cache_kwargs

#: Shortest ``--lengths`` accepted: the passkey prompt's fixed parts take ~70 tokens of any common tokenizer.
MIN_CONTEXT_TOKENS = 128


def _split_name(name: str) -> tuple[str, int | None]:
    """``"snapkv@256"`` → ``("snapkv", 256)``; ``"full"`` → ``("full", None)``."""
    policy, sep, budget = name.rpartition("@")
    return (policy, int(budget)) if sep and budget.isdigit() else (name, None)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (cache, context length): mean exact match, answer log-likelihood, KV bytes held and the
    fraction of the full cache's, mean decoding seconds per token and the speed relative to the full cache."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        groups[(rec["name"], rec["context_tokens"])].append(rec)
    rows = []
    for (name, length), recs in groups.items():
        policy, budget = _split_name(name)
        kv = [r["kv_bytes"] for r in recs if r.get("kv_bytes") is not None]
        rows.append({
            "name": name,
            "policy": policy,
            "budget": budget,
            "context_tokens": length,
            "samples": len(recs),
            "exact_match": sum(r["exact_match"] for r in recs) / len(recs),
            "answer_logprob": sum(r["answer_logprob"] for r in recs) / len(recs),
            "kv_bytes": sum(kv) / len(kv) if kv else None,
            "decode_s_per_token": sum(r["decode_s_per_token"] for r in recs) / len(recs),
        })
    for row in rows:
        full = next((r for r in rows if r["name"] == "full" and r["context_tokens"] == row["context_tokens"]), None)
        has_kv = full is not None and full["kv_bytes"] and row["kv_bytes"] is not None
        row["kv_fraction"] = row["kv_bytes"] / full["kv_bytes"] if has_kv else None  # type: ignore[index]
        speed = full is not None and row["decode_s_per_token"] > 0
        row["decode_speed_vs_full"] = full["decode_s_per_token"] / row["decode_s_per_token"] if speed else None  # type: ignore[index]
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per (cache, length): budget, KV held, exact match, log-likelihood, decoding speed vs full.

    Rows are grouped by context length, the full cache first, then policy by policy in ascending budget.
    """
    order = {name: i for i, name in enumerate(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))}
    ranked = sorted(rows, key=lambda r: (r["context_tokens"], r["policy"] != "full", order.get(r["policy"], -1),
                                         r["budget"] or 0))
    width = max(12, *(len(r["policy"]) for r in rows)) + 1
    head = (f"{'policy':<{width}} {'tokens':>6} {'budget':>6} {'KV MiB':>7} {'% full':>6} {'EM':>5} "
            f"{'logp':>7} {'ms/tok':>7} {'speed':>6}")
    lines = [head, "-" * len(head)]
    previous = None
    for r in ranked:
        if previous is not None and r["policy"] != previous:
            lines.append("")
        previous = r["policy"]
        kv = "" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 2**20:7.2f}"
        frac = "" if r["kv_fraction"] is None else f"{100 * r['kv_fraction']:5.1f}%"
        speed = "" if r["decode_speed_vs_full"] is None else f"{r['decode_speed_vs_full']:5.2f}x"
        lines.append(
            f"{r['policy']:<{width}} {r['context_tokens']:>6} {'-' if r['budget'] is None else r['budget']:>6} "
            f"{kv:>7} {frac:>6} {100 * r['exact_match']:4.0f}% {r['answer_logprob']:7.2f} "
            f"{1000 * r['decode_s_per_token']:7.1f} {speed:>6}"
        )
    return "\n".join(lines)


def _warm_up(model: Any, caches: list[Any]) -> None:
    """A short prefill and two decoding steps on a full and a compressed cache, untimed, so the first
    timed cache does not pay for first-call set-up (kernel selection, allocator growth)."""
    from transformers import DynamicCache

    ids = torch.arange(3, 67, device=model.device)[None]
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing was compressed": the warm-up prompt may fit the budget
        for cache in [DynamicCache(config=model.config), *caches]:
            token = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
            for _ in range(2):
                token = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_niah_command(args: argparse.Namespace) -> int:
    """Validate everything, load the default model, run the grid, print and save results."""
    # Validate every policy/budget before loading anything.
    specs = [(p, b) for p in args.policies if p != "full" for b in args.budgets]
    built = {f"{p}@{b}": make_policy(parse_policy_spec(p)[0], budget=b, **parse_policy_spec(p)[1]) for p, b in specs}
    for length in args.lengths:
        if length < MIN_CONTEXT_TOKENS:
            raise ValueError(f"--lengths: each context length must be ≥ {MIN_CONTEXT_TOKENS} tokens (the passkey "
                             f"prompt's instructions, needle and question take ~70 tokens); got {length}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be ≥ 1; got {args.max_new_tokens}")
    out = check_output_file(args.output)
    for depth in args.depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"--depths: each depth must be in [0, 1]; got {depth}")

    from kvsieve.engine.kv_cache import KVCache
    from kvsieve.eval.niah import run_niah
    from kvsieve.models.arguments import check_model_args, load_model_from_args
    from kvsieve.policies.model_check import check_policies_for_model

    check_model_args(args)
    check_policies_for_model(args, list(built.values()))
    started, cpu_started, load_before = time.perf_counter(), time.process_time(), os.getloadavg()
    model, tokenizer = load_model_from_args(args)

    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(args.lengths) + args.max_new_tokens > limit:
        raise ValueError(f"--lengths: {max(args.lengths)} tokens + {args.max_new_tokens} new exceed the model's "
                         f"{limit} positions (max_position_embeddings)")
    _warm_up(model, [KVCache(model, p) for p in list(built.values())[:1]])
    factories: dict[str, Callable[[], Any]] = {"full": lambda: None}
    for name, policy in built.items():
        factories[name] = lambda p=policy: KVCache(model, p)
    def payload(records: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        return {
            "task": "niah_passkey",
            "complete": complete,
            "model": "SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model,
            "dtype": args.dtype,
            "policies": {name: str(policy) for name, policy in built.items()},
            "lengths": args.lengths, "depths": args.depths, "seeds": args.seeds,
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpu": _cpu_model(), "wall_s": wall_s, "cpu_s": cpu_s,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "summary": summarize(records),
            "records": [{k: v for k, v in r.items() if k != "generated_ids"} for r in records],
        }

    records = run_niah(
        model, tokenizer, lengths=args.lengths, depths=args.depths, seeds=args.seeds,
        make_cache_fns=factories, progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
        on_sample=lambda so_far: write_json_atomic(out, payload(so_far, complete=False)),
    )
    final = payload(records, complete=True)
    write_json_atomic(out, final)
    rows = final["summary"]
    print(format_table(rows))
    print(f"EM: exact match; logp: teacher-forced log-likelihood of the pass key (nats, higher is better); "
          f"speed: decoding tokens/s vs the full cache; {len(args.depths) * len(args.seeds)} samples per row; "
          f"{final['wall_s'] / 60:.1f} min ({final['cpu_s'] / 60:.1f} CPU min) with {torch.get_num_threads()} "
          "torch threads")
    print(f"results: {out}")
    if not args.no_plot:
        from kvsieve.eval.niah_plot import plot_niah

        try:
            figure = plot_niah(rows, out.with_suffix(".png"))
        except ImportError:
            print("no plot: matplotlib is not installed (pip install 'kvsieve[plots]')", file=sys.stderr)
        else:
            print(f"plot: {figure}")
    return 0
