"""``kvsieve niah``: the passkey comparison on the default model, as a table and a JSON file."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvsieve.policies.registry import make_policy


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean exact match and answer log-likelihood per (name, context length)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        groups[(rec["name"], rec["context_tokens"])].append(rec)
    rows = []
    for (name, length), recs in groups.items():
        rows.append({
            "name": name,
            "context_tokens": length,
            "samples": len(recs),
            "exact_match": sum(r["exact_match"] for r in recs) / len(recs),
            "answer_logprob": sum(r["answer_logprob"] for r in recs) / len(recs),
        })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per cache, one ``EM% / logprob`` column per context length."""
    lengths = sorted({r["context_tokens"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    cell = {(r["name"], r["context_tokens"]): r for r in rows}
    width = max(len(n) for n in names) + 2
    header = "policy".ljust(width) + "".join(f"{f'{n} tok: EM  logp':>22}" for n in lengths)
    lines = [header, "-" * len(header)]
    for name in names:
        parts = []
        for n in lengths:
            r = cell.get((name, n))
            parts.append(f"{'':>9}{r['exact_match'] * 100:5.0f}% {r['answer_logprob']:6.2f}" if r else " " * 22)
        lines.append(name.ljust(width) + "".join(parts))
    return "\n".join(lines)


def _value(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_policy_spec(spec: str) -> tuple[str, dict[str, object]]:
    """``"h2o_caote:schedule=blockwise:block_size=64"`` → ``("h2o_caote", {...})``."""
    name, *pairs = spec.split(":")
    params: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--policies: expected name[:key=value...]; got {spec!r}")
        params[key] = _value(value)
    return name, params


def run_niah_command(args: argparse.Namespace) -> int:
    """Validate everything, load the default model, run the grid, print and save results."""
    # Validate every policy/budget before loading anything.
    specs = [(p, b) for p in args.policies if p != "full" for b in args.budgets]
    built = {f"{p}@{b}": make_policy(parse_policy_spec(p)[0], budget=b, **parse_policy_spec(p)[1]) for p, b in specs}
    for length in args.lengths:
        if length < 64:
            raise ValueError(f"--lengths: each context length must be ≥ 64 tokens; got {length}")
    for depth in args.depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"--depths: each depth must be in [0, 1]; got {depth}")

    from kvsieve.cache.kv_cache import KVCache
    from kvsieve.eval.niah import run_niah
    from kvsieve.models.arguments import check_model_args, load_model_from_args

    check_model_args(args)
    model, tokenizer = load_model_from_args(args)

    factories: dict[str, Callable[[], Any]] = {"full": lambda: None}
    for name, policy in built.items():
        factories[name] = lambda p=policy: KVCache(model, p)
    records = run_niah(
        model, tokenizer, lengths=args.lengths, depths=args.depths, seeds=args.seeds,
        make_cache_fns=factories, progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
    )
    rows = summarize(records)
    print(format_table(rows))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "task": "niah_passkey",
        "model": "SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model,
        "dtype": args.dtype,
        "policies": {name: str(policy) for name, policy in built.items()},
        "lengths": args.lengths, "depths": args.depths, "seeds": args.seeds,
        "torch": torch.__version__, "python": platform.python_version(),
        "summary": rows,
        "records": [{k: v for k, v in r.items() if k != "generated_ids"} for r in records],
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0
