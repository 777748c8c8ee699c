"""Per-turn report of a ``multiturn`` sweep (``kvsieve eval --tasks multiturn``): do later turns collapse?

For each (policy, budget) and turn: mean string-match score, the teacher-forced answer log-likelihood
gap to the full cache (nats, summed over the turn's answer; ``turn_answer_logprobs_full −
turn_answer_logprobs``) and the mean KL(full ‖ compressed) per answer token, each ± its standard error
over samples, on the samples every cache finished.

Usage: ``python benchmarks/multiturn_report.py results/mt/records.jsonl [--output report.md]``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from ruler_report import mean_se


def report(path: Path) -> str:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = [r for r in records if r.get("task") == "multiturn" and "turn_scores" in r]
    by_sample: dict[tuple[int, int], dict[tuple[str, Any], dict[str, Any]]] = defaultdict(dict)
    for rec in records:
        by_sample[(rec["length"], rec["sample"])][(rec["policy"], rec["budget"])] = rec
    caches = sorted({c for g in by_sample.values() for c in g}, key=lambda c: (c[0] != "full", c[0], c[1] or 0))
    complete = [g for g in by_sample.values() if all(c in g for c in caches)]
    turns = min(len(r["turn_scores"]) for g in complete for r in g.values()) if complete else 0
    lines = [f"Complete samples: {len(complete)}; turns: {turns}", "",
             "| policy | budget | turn | n | score | gap to full (nats) | KL(full ‖ compressed) |",
             "|---|---|---|---|---|---|---|"]
    for policy, budget in caches:
        for turn in range(turns):
            recs = [g[(policy, budget)] for g in complete]
            s, s_se, n = mean_se([r["turn_scores"][turn] for r in recs])
            gap, gap_se, _ = mean_se([r["turn_answer_logprobs_full"][turn] - r["turn_answer_logprobs"][turn]
                                      for r in recs])
            kl, kl_se, _ = mean_se([r["turn_kl"][turn] for r in recs])
            lines.append(f"| {policy} | {budget if budget is not None else '–'} | {turn + 1} | {n} | "
                         f"{s:.2f} ± {s_se:.2f} | {gap:.2f} ± {gap_se:.2f} | {kl:.3f} ± {kl_se:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    text = report(args.records)
    if args.output is not None:
        args.output.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
