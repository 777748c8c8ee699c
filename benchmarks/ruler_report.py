"""Report of a RULER sweep (``kvsieve eval``): suite averages per length and paired differences.

Only *complete* task samples count (every cache of the sweep has a record for that task, length and
sample), so every policy is compared on exactly the same samples. For each (length, policy, budget):
mean string-match score, log-prob gap to the full cache (nats, summed over the answer) and mean
KL(full ‖ compressed) per answer token, each ± its standard error over samples. Then, per budget,
the paired difference of every policy against a reference policy on the same samples (score: policy −
reference; KL: reference − policy, so positive means better than the reference), pooled over lengths.

Usage: ``python benchmarks/ruler_report.py results/ruler/records.jsonl [--reference snapkv]
[--output docs/results/ruler/report.md]``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

Key = tuple[str, int, int]  # task, length, sample
Cache = tuple[str, int | None]  # policy, budget


def mean_se(values: list[float]) -> tuple[float, float, int]:
    """Mean, standard error (NaN below two values) and count."""
    n = len(values)
    mean = sum(values) / n
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else math.nan
    return mean, se, n


def label(rec: dict[str, Any], with_params: bool) -> str:
    """The policy, with its parameters when ``with_params`` (``kvzip(action=quantize,bits=4)``)."""
    params = rec.get("params") or {}
    if not with_params or not params:
        return str(rec["policy"])
    return f"{rec['policy']}(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"


def complete_groups(path: Path) -> dict[Key, dict[Cache, dict[str, Any]]]:
    """Records by task sample, keeping only samples that every cache of the sweep finished.

    A policy run with several parameter sets at one (budget, length) (``kvzip`` and ``kvzip:action=quantize``) is
    told apart by its parameters; one whose parameters only follow the length (DuoAttention's matched split) is not.
    """
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    variants: dict[tuple[str, Any, int], set[str]] = defaultdict(set)
    for rec in records:
        variants[(rec["policy"], rec["budget"], int(rec["length"]))].add(json.dumps(rec.get("params") or {},
                                                                                    sort_keys=True))
    split = {policy for (policy, _, _), seen in variants.items() if len(seen) > 1}
    groups: dict[Key, dict[Cache, dict[str, Any]]] = defaultdict(dict)
    for rec in records:
        cache = (label(rec, rec["policy"] in split), rec["budget"])
        groups[(rec["task"], int(rec["length"]), int(rec["sample"]))][cache] = rec
    caches = set().union(*(set(g) for g in groups.values())) if groups else set()
    return {k: g for k, g in groups.items() if set(g) == caches}


def report(path: Path, reference: str) -> str:
    groups = complete_groups(path)
    caches = sorted({c for g in groups.values() for c in g}, key=lambda c: (c[0] != "full", c[0], c[1] or 0))
    policies = list(dict.fromkeys(p for p, _ in caches if p != "full"))
    budgets = sorted({b for _, b in caches if b is not None})
    lengths = sorted({k[1] for k in groups})
    tasks = sorted({k[0] for k in groups})
    lines = [f"Complete task samples: {len(groups)} ({len(tasks)} tasks × lengths {lengths}); per task and length:"]
    for length in lengths:
        counts = {t: sum(1 for k in groups if k[0] == t and k[1] == length) for t in tasks}
        lines.append(f"- {length}: " + ", ".join(f"{t} {n}" for t, n in counts.items()))
    lines += ["", "| length | policy | budget | n | score | gap to full (nats) | KL(full ‖ compressed) |",
              "|---|---|---|---|---|---|---|"]
    for length in lengths:
        keys = [k for k in groups if k[1] == length]
        for policy, budget in caches:
            recs = [groups[k][(policy, budget)] for k in keys]
            s, s_se, n = mean_se([r["score"] for r in recs])
            g, g_se, _ = mean_se([r["logprob_gap"] for r in recs])
            kl, kl_se, _ = mean_se([r["kl_full_compressed"] for r in recs])
            lines.append(f"| {length} | {policy} | {budget if budget is not None else '–'} | {n} | "
                         f"{s:.3f} ± {s_se:.3f} | {g:.1f} ± {g_se:.1f} | {kl:.3f} ± {kl_se:.3f} |")
    lines += ["", f"Paired differences against {reference}, pooled over lengths (mean ± SE over the same samples; "
              "score: policy − reference, KL: reference − policy; positive = better than the reference):", "",
              "| budget | policy | n | Δ score | Δ KL |", "|---|---|---|---|---|"]
    for budget in budgets:
        for policy in policies:
            if policy == reference or (policy, budget) not in caches or (reference, budget) not in caches:
                continue  # a sweep may run some policies at some budgets only
            ds = [g[(policy, budget)]["score"] - g[(reference, budget)]["score"] for g in groups.values()]
            dk = [g[(reference, budget)]["kl_full_compressed"] - g[(policy, budget)]["kl_full_compressed"]
                  for g in groups.values()]
            a, a_se, n = mean_se(ds)
            b, b_se, _ = mean_se(dk)
            lines.append(f"| {budget} | {policy} | {n} | {a:+.3f} ± {a_se:.3f} | {b:+.3f} ± {b_se:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path)
    parser.add_argument("--reference", default="snapkv")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    text = report(args.records, args.reference)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    print(text, end="")


if __name__ == "__main__":
    main()
