"""Summaries of a sweep: means and standard errors per (task, length, policy, budget), as CSV and markdown.

Every row carries the full cache's value of the same (task, length) beside its own (``score_full``,
``answer_logprob_full``, ``ppl_full``, ``nll_full``), so a compressed row reads without looking up the
reference row. The standard error is the sample standard deviation over √n (blank for n < 2).
Per-turn scores of multi-turn records (a list field whose name contains ``turn``) are averaged turn by
turn into ``<field>_<turn>`` columns.

``summary.md`` opens with the suite average: per (length, policy, budget), the mean over every sample
of every task but perplexity (each sample counts once, so a task with more samples weighs more),
with its standard error over those samples and the number of tasks — the figure that tells whether a
difference between policies is larger than the sampling noise.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvsieve.eval.results import params_key
from kvsieve.eval.sweep_config import FULL
from kvsieve.policies.spec import label_of

#: Scalar metrics summarised (``kv_ratio`` is derived: ``kv_bytes_held / kv_bytes_full``).
METRICS = ("score", "answer_logprob", "logprob_gap", "kl_full_compressed", "nll", "ppl", "kv_ratio")
#: Metrics shown with the full cache's value beside them.
REFERENCED = ("score", "answer_logprob", "nll", "ppl")
GROUP_FIELDS = ("task", "length", "policy", "params", "label", "budget", "samples")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def metric_value(record: Mapping[str, Any], metric: str) -> float | None:
    """A record's value of ``metric`` (None when missing, non-numeric or not finite)."""
    if metric == "kv_ratio":
        held, full = _number(record.get("kv_bytes_held")), _number(record.get("kv_bytes_full"))
        return held / full if held is not None and full else None
    return _number(record.get(metric))


def mean_se(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and standard error (None for no values; SE None for fewer than two)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def _turn_fields(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """List-valued per-turn fields and their longest length."""
    found: dict[str, int] = {}
    for rec in records:
        for key, value in rec.items():
            if "turn" in key and isinstance(value, list) and value and all(_number(v) is not None for v in value):
                found[key] = max(found.get(key, 0), len(value))
    return found


def summarize(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, length, policy, params, budget), sorted; full cache first in each block."""
    records = list(records)
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for rec in records:
        budget = rec.get("budget")
        groups[(rec["task"], int(rec["length"]), rec["policy"], params_key(rec.get("params")), budget)].append(rec)
    turns = _turn_fields(records)
    rows = []
    for (task, length, policy, pkey, budget), recs in groups.items():
        params = recs[0].get("params") or {}
        row: dict[str, Any] = {
            "task": task, "length": length, "policy": policy, "params": pkey if params else "",
            "label": label_of(policy, params), "budget": budget, "samples": len(recs),
        }
        for metric in METRICS:
            values = [v for v in (metric_value(r, metric) for r in recs) if v is not None]
            row[metric], row[f"{metric}_se"] = mean_se(values)
        for name, count in turns.items():
            for turn in range(count):
                values = [float(r[name][turn]) for r in recs if isinstance(r.get(name), list) and len(r[name]) > turn]
                row[f"{name}_{turn + 1}"] = mean_se(values)[0]
        rows.append(row)
    reference = {(r["task"], r["length"]): r for r in rows if r["policy"] == FULL and r["budget"] is None}
    for row in rows:
        ref = reference.get((row["task"], row["length"]), {})
        for metric in REFERENCED:
            row[f"{metric}_full"] = ref.get(metric)
    rows.sort(key=lambda r: (r["task"], r["length"], r["policy"] != FULL, r["label"], r["budget"] or 0))
    return rows


SUITE_METRICS = ("score", "logprob_gap", "kl_full_compressed", "kv_ratio")


def suite_rows(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Mean ± SE over all samples of all non-perplexity tasks, per (length, policy, params, budget)."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for rec in records:
        if rec.get("ppl") is not None:
            continue
        groups[(int(rec["length"]), rec["policy"], params_key(rec.get("params")), rec.get("budget"))].append(rec)
    rows = []
    for (length, policy, _, budget), recs in groups.items():
        row: dict[str, Any] = {
            "length": length, "policy": policy, "label": label_of(policy, recs[0].get("params") or {}),
            "budget": budget, "samples": len(recs), "tasks": len({r["task"] for r in recs}),
        }
        for metric in SUITE_METRICS:
            values = [v for v in (metric_value(r, metric) for r in recs) if v is not None]
            row[metric], row[f"{metric}_se"] = mean_se(values)
        rows.append(row)
    rows.sort(key=lambda r: (r["length"], r["policy"] != FULL, r["label"], r["budget"] or 0))
    return rows


def suite_markdown(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The suite-average table (empty when there is nothing to average)."""
    if not rows:
        return []
    head = ["length", "policy", "budget", "tasks", "n", "score", "gap", "KL", "KV held"]
    title = "## Suite average (all tasks but perplexity)"
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r["length"]), r["label"], "–" if r["budget"] is None else str(r["budget"]), str(r["tasks"]),
            str(r["samples"]), _fmt(r["score"], r["score_se"]), _fmt(r["logprob_gap"], r["logprob_gap_se"], 2),
            _fmt(r["kl_full_compressed"], r["kl_full_compressed_se"]),
            "–" if r["kv_ratio"] is None else f"{100 * r['kv_ratio']:.1f}%",
        ]) + " |")
    return [*lines, ""]


def summary_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """CSV column order: group fields, then each metric with its SE and full-cache value."""
    columns = list(GROUP_FIELDS)
    for metric in METRICS:
        columns += [metric, f"{metric}_se"]
        if metric in REFERENCED:
            columns.append(f"{metric}_full")
    extra = sorted({k for r in rows for k in r if k not in columns})
    return columns + extra


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    """Write the summary rows as CSV (blank cells for missing values)."""
    columns = summary_columns(rows)
    with Path(path).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})


def _fmt(value: float | None, se: float | None = None, digits: int = 3) -> str:
    if value is None:
        return "–"
    text = f"{value:.{digits}f}"
    return f"{text} ± {se:.{digits}f}" if se is not None else text


def to_markdown(rows: Sequence[Mapping[str, Any]], suite: Sequence[Mapping[str, Any]] = ()) -> str:
    """The suite average, then one table per task; ``±`` gives the standard error, ``full`` the full cache's value."""
    lines = ["# Sweep summary", "", "Mean ± standard error over samples; `full` = the full cache's value.", ""]
    lines += suite_markdown(suite)
    for task in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == task]
        perplexity = any(r.get("ppl") is not None for r in task_rows)
        turns = sorted((k for k in {k for r in task_rows for k in r} if k.startswith("turn_scores_")),
                       key=lambda k: int(k.rsplit("_", 1)[1]))
        head = ["length", "policy", "budget", "n", "score", "score full", "answer logp", "logp full", "gap", "KL"]
        if perplexity:
            head += ["ppl", "ppl full"]
        head += ["KV held"] + (["score per turn"] if turns else [])
        lines += [f"## {task}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in task_rows:
            cells = [
                str(r["length"]), r["label"], "–" if r["budget"] is None else str(r["budget"]), str(r["samples"]),
                _fmt(r["score"], r["score_se"]), _fmt(r["score_full"]),
                _fmt(r["answer_logprob"], r["answer_logprob_se"], 2), _fmt(r["answer_logprob_full"], None, 2),
                _fmt(r["logprob_gap"], r["logprob_gap_se"], 2),
                _fmt(r["kl_full_compressed"], r["kl_full_compressed_se"]),
            ]
            if perplexity:
                cells += [_fmt(r["ppl"], r["ppl_se"], 2), _fmt(r["ppl_full"], None, 2)]
            cells.append("–" if r["kv_ratio"] is None else f"{100 * r['kv_ratio']:.1f}%")
            if turns:
                cells.append(" / ".join(_fmt(r.get(k), None, 2) for k in turns))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_summary(records: Iterable[Mapping[str, Any]], out_dir: str | Path) -> list[dict[str, Any]]:
    """Write ``summary.csv`` and ``summary.md`` into ``out_dir``; returns the rows."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = list(records)
    rows = summarize(records)
    write_csv(rows, out / "summary.csv")
    (out / "summary.md").write_text(to_markdown(rows, suite_rows(records)), encoding="utf-8")
    return rows
