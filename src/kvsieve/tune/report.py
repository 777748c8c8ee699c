"""``kvsieve tune``'s report: every trial and baseline as (KV bytes held, fidelity), the Pareto frontier marked.

Writes ``report.md`` (the frontier, the best feasible trial against every baseline, every trial), ``trials.csv``
and, with matplotlib, ``pareto.png``/``pareto.svg``: KL(full ‖ policy) per answer token against the KV bytes
held as a share of the full cache, trials as dots (infeasible ones hollow), baselines as labelled crosses, the
frontier over trials and baselines as a line.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsieve.tune.config import ANCHOR, TrialResult, TuneConfig


@dataclass(frozen=True)
class Point:
    """One trial or baseline on the bytes–fidelity plane."""

    label: str
    kind: str  # "trial" | "baseline"
    number: int | None
    kl: float
    logprob_gap: float
    score: float
    bytes_share: float  # KV bytes held / the full cache's
    bytes_over_anchor: float  # KV bytes held / snapkv's at the same budget
    feasible: bool


def pareto(points: Sequence[Point]) -> list[Point]:
    """The points no other point beats on both bytes and KL (ties kept), by increasing bytes."""
    frontier = []
    for p in sorted(points, key=lambda q: (q.bytes_share, q.kl)):
        if not frontier or p.kl < frontier[-1].kl:
            frontier.append(p)
    return frontier


def collect(study: Any, baselines: dict[str, TrialResult], anchor_bytes: float,
            byte_tolerance: float) -> list[Point]:
    """Every complete trial and every baseline as a :class:`Point`."""
    import optuna

    points = []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        result = TrialResult(**trial.user_attrs["result"])
        points.append(_point(trial.user_attrs["label"], "trial", trial.number, result, anchor_bytes, byte_tolerance))
    for name, result in baselines.items():
        points.append(_point(name, "baseline", None, result, anchor_bytes, byte_tolerance))
    return points


def _point(label: str, kind: str, number: int | None, r: TrialResult, anchor_bytes: float, tol: float) -> Point:
    over = r.kv_bytes / anchor_bytes
    return Point(label, kind, number, r.kl, r.logprob_gap, r.score, r.kv_bytes / r.kv_bytes_full, over,
                 over <= 1.0 + tol)


def write_report(out: Path, study: Any, baselines: dict[str, TrialResult], anchor_bytes: float,
                 config: TuneConfig) -> list[Path]:
    """``report.md``, ``trials.csv`` and the plot (when matplotlib is installed); returns the files written."""
    import optuna

    points = collect(study, baselines, anchor_bytes, config.byte_tolerance)
    frontier = pareto(points)
    states = optuna.trial.TrialState
    counts = {state.name.lower(): len(study.get_trials(deepcopy=False, states=(state,)))
              for state in (states.COMPLETE, states.PRUNED, states.FAIL)}
    written = [_write_csv(out / "trials.csv", points, frontier)]
    (out / "report.md").write_text(_markdown(points, frontier, counts, config), encoding="utf-8")
    written.append(out / "report.md")
    written += _plot(out, points, frontier, config)
    return written


def _row(p: Point, on_frontier: bool) -> str:
    mark = " ◆" if on_frontier else ""
    number = "" if p.number is None else f"#{p.number} "
    feasible = "" if p.feasible else " (over budget)"
    return (f"| {number}{p.label}{mark}{feasible} | {p.kind} | {p.kl:.3f} | {p.logprob_gap:.2f} | {p.score:.2f} | "
            f"{100 * p.bytes_share:.2f}% | {p.bytes_over_anchor:.3f} |")


def _markdown(points: list[Point], frontier: list[Point], counts: dict[str, int], config: TuneConfig) -> str:
    cal = config.calibration
    on = set(map(id, frontier))
    head = ("| composition | kind | KL / answer token | log-lik. gap | exact match | KV bytes (of full) | "
            f"bytes / {ANCHOR} |\n|---|---|---|---|---|---|---|\n")
    trials = [p for p in points if p.kind == "trial"]
    best = min((p for p in trials if p.feasible), key=lambda p: p.kl, default=None)
    lines = [
        f"# kvsieve tune: {config.model}, budget {config.budget} entries per KV head",
        "",
        f"Calibration set: tasks {', '.join(cal.tasks)}; lengths {', '.join(map(str, cal.lengths))}; {cal.samples} "
        f"sample(s) each; sweep seed {cal.seed} (calibration essays only). Trials: {counts['complete']} complete, "
        f"{counts['pruned']} pruned, {counts['fail']} refused or failed. Objective: KL(full ‖ policy) per answer "
        f"token, lower is better; a trial is feasible when it holds ≤ {1 + config.byte_tolerance:.2f}× the KV bytes "
        f"of `{ANCHOR}` at the same budget. ◆ = on the Pareto frontier (bytes vs KL) of trials and baselines.",
        "",
    ]
    if best is not None:
        lines += ["## Best feasible trial against the baselines", "", head.rstrip("\n")]
        ranked = sorted([best, *[p for p in points if p.kind == "baseline"]], key=lambda p: p.kl)
        lines += [_row(p, id(p) in on) for p in ranked] + [""]
    lines += ["## Pareto frontier", "", head.rstrip("\n")] + [_row(p, True) for p in frontier] + [""]
    lines += ["## Every complete trial", "", head.rstrip("\n")]
    lines += [_row(p, id(p) in on) for p in sorted(trials, key=lambda p: p.kl)]
    return "\n".join(lines) + "\n"


def _write_csv(path: Path, points: list[Point], frontier: list[Point]) -> Path:
    on = set(map(id, frontier))
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["label", "kind", "trial", "kl", "logprob_gap", "exact_match", "kv_bytes_share",
                         "bytes_over_anchor", "feasible", "pareto"])
        for p in points:
            writer.writerow([p.label, p.kind, "" if p.number is None else p.number, p.kl, p.logprob_gap, p.score,
                             p.bytes_share, p.bytes_over_anchor, p.feasible, id(p) in on])
    return path


def _plot(out: Path, points: list[Point], frontier: list[Point], config: TuneConfig) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:  # the plots extra is optional: the table says the same
        return []
    fig, ax = plt.subplots(figsize=(8, 5.5))
    trials = [p for p in points if p.kind == "trial" and math.isfinite(p.kl)]
    for feasible, style in ((True, {"color": "tab:blue"}), (False, {"facecolors": "none", "edgecolors": "tab:blue"})):
        chosen = [p for p in trials if p.feasible is feasible]
        if chosen:
            ax.scatter([100 * p.bytes_share for p in chosen], [p.kl for p in chosen], s=22, alpha=0.7,
                       label="trials" if feasible else "trials over budget", **style)
    for p in (p for p in points if p.kind == "baseline"):
        ax.scatter([100 * p.bytes_share], [p.kl], marker="x", color="tab:red", s=40)
        ax.annotate(p.label, (100 * p.bytes_share, p.kl), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.plot([100 * p.bytes_share for p in frontier], [p.kl for p in frontier], color="black", lw=1,
            drawstyle="steps-post", label="Pareto frontier")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    percent = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(percent)
    ax.xaxis.set_minor_formatter(percent)
    ax.set_xlabel("KV bytes held (% of the full cache, log scale)")
    ax.set_ylabel("KL(full ‖ policy) per answer token")
    ax.set_title(f"kvsieve tune: {config.model}, budget {config.budget}/head (red: seed methods and baselines)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written = []
    for fmt in ("png", "svg"):
        path = out / f"pareto.{fmt}"
        fig.savefig(path, dpi=130)
        written.append(path)
    plt.close(fig)
    return written
