"""``kvsieve plot``: figures from a sweep's ``records.jsonl`` (matplotlib, Agg backend, PNG and SVG).

* ``suite_average`` (two or more tasks): mean score, log-prob gap and KL to the full cache over every
  sample of every non-perplexity task vs budget, per length and policy (``summary.md``'s first table).
* ``budget_<task>``: score and answer log-likelihood vs budget, one column per context length, one line
  per policy (± standard error), the full cache as a dashed horizontal line. Exact match collapses
  under compression on a 135M model; the log-likelihood of the true answer still separates policies.
  Perplexity tasks show perplexity and NLL instead.
* ``needle_<task>_score`` / ``needle_<task>_logprob``: for records with a ``depth`` (needle position),
  a length × depth heatmap of the mean score / answer log-likelihood per policy and budget (full first).
* ``perplexity_<task>``: perplexity vs token position per policy, one panel per (length, budget), from
  a per-position NLL list in the records (any list field whose name contains ``nll``), binned; records
  without one give perplexity vs context length instead.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from kvsieve.eval.summary import mean_se, metric_value, suite_rows, summarize
from kvsieve.eval.sweep_config import FULL
from kvsieve.policies.spec import label_of

FORMATS = ("png", "svg")
Record = Mapping[str, Any]
POSITION_BINS = 32


def _colors(labels: Iterable[str]) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(sorted(set(labels)))}


def _save(fig: Figure, out: Path, stem: str, formats: Sequence[str]) -> list[Path]:
    paths = []
    for fmt in formats:
        path = out / f"{stem}.{fmt}"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def _is_perplexity(records: Sequence[Record]) -> bool:
    return any(metric_value(r, "ppl") is not None for r in records)


def _budget_figure(rows: Sequence[Record], metrics: Sequence[tuple[str, str]], title: str,
                   colors: Mapping[str, Any]) -> Figure:
    """Metric rows × one column per length; one line per policy label (± SE), full cache dashed."""
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(len(metrics), len(lengths), figsize=(4.2 * len(lengths) + 1.2, 3.2 * len(metrics)),
                             squeeze=False)
    for col, length in enumerate(lengths):
        here = [r for r in rows if r["length"] == length]
        budgets = sorted({r["budget"] for r in here if r["budget"] is not None})
        for row_i, (metric, ylabel) in enumerate(metrics):
            ax = axes[row_i][col]
            full = next((r for r in here if r["policy"] == FULL), None)
            if full is not None and full.get(metric) is not None:
                ax.axhline(full[metric], color="black", linestyle="--", linewidth=1.2, label="full cache")
            for label in dict.fromkeys(r["label"] for r in here if r["policy"] != FULL):
                pts = sorted((r for r in here if r["label"] == label and r.get(metric) is not None),
                             key=lambda r: r["budget"])
                if pts:
                    ax.errorbar([p["budget"] for p in pts], [p[metric] for p in pts],
                                yerr=[p.get(f"{metric}_se") or 0.0 for p in pts], marker="o", markersize=4,
                                capsize=2, color=colors[label], label=label)
            if budgets:
                ax.set_xscale("log", base=2)
                ax.set_xticks(budgets, [str(b) for b in budgets])
                ax.minorticks_off()
            if metric == "score":
                ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
            if row_i == 0:
                ax.set_title(f"{length} tokens")
            if row_i == len(metrics) - 1:
                ax.set_xlabel("budget (entries per KV head)")
            if col == 0:
                ax.set_ylabel(ylabel)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_budget_curves(records: Sequence[Record], out: Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """``budget_<task>``: two metric rows × one column per length, per task."""
    rows = summarize(records)
    paths: list[Path] = []
    colors = _colors(r["label"] for r in rows if r["policy"] != FULL)
    for task in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == task]
        metrics = (("ppl", "perplexity"), ("nll", "NLL (nats/token)")) if _is_perplexity(
            [r for r in records if r["task"] == task]) else (("score", "score (string match)"),
                                                             ("answer_logprob", "answer log-likelihood"))
        fig = _budget_figure(task_rows, metrics, f"{task}: metric vs KV budget", colors)
        paths += _save(fig, out, f"budget_{task}", formats)
    return paths


def plot_suite_average(records: Sequence[Record], out: Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """``suite_average``: every non-perplexity task pooled (as ``summary.md``'s first table); ≥ 2 tasks."""
    rows = suite_rows(records)
    if len({r["task"] for r in records if metric_value(r, "ppl") is None}) < 2:
        return []
    colors = _colors(r["label"] for r in rows if r["policy"] != FULL)
    metrics = (("score", "mean score (string match)"), ("logprob_gap", "log-prob gap to full (nats)"),
               ("kl_full_compressed", "KL(full ‖ compressed)"))
    tasks = len({r["task"] for r in records if metric_value(r, "ppl") is None})
    fig = _budget_figure(rows, metrics, f"suite average over {tasks} tasks vs KV budget", colors)
    return _save(fig, out, "suite_average", formats)


def _heat_grid(recs: Sequence[Record], metric: str, lengths: list[int], depths: list[float]) -> list[list[float]]:
    cells: dict[tuple[int, float], list[float]] = defaultdict(list)
    for r in recs:
        value = metric_value(r, metric)
        if value is not None:
            cells[(int(r["length"]), round(float(r["depth"]), 3))].append(value)
    grid = []
    for n in lengths:
        means = (mean_se(cells.get((n, d), []))[0] for d in depths)
        grid.append([math.nan if m is None else m for m in means])
    return grid


#: (record field, colour-bar label, colour map, file-name suffix)
HEATMAP_METRICS = (
    ("score", "score", "RdYlGn", "score"),
    ("answer_logprob", "answer log-likelihood", "viridis", "logprob"),
)


def plot_needle_heatmaps(records: Sequence[Record], out: Path, formats: Sequence[str] = FORMATS,
                         columns: int = 4) -> list[Path]:
    """``needle_<task>_score`` and ``needle_<task>_logprob``: one length × depth panel per cache."""
    paths: list[Path] = []
    with_depth = [r for r in records if isinstance(r.get("depth"), int | float) and not isinstance(r["depth"], bool)]
    for task in dict.fromkeys(r["task"] for r in with_depth):
        recs = [r for r in with_depth if r["task"] == task]
        lengths = sorted({int(r["length"]) for r in recs})
        depths = sorted({round(float(r["depth"]), 3) for r in recs})
        caches = sorted({(r["policy"] != FULL, label_of(r["policy"], r.get("params")), r.get("budget") or 0)
                         for r in recs})
        for metric, name, cmap, suffix in HEATMAP_METRICS:
            values = [v for v in (metric_value(r, metric) for r in recs) if v is not None]
            if not values:
                continue
            vmin, vmax = (0.0, 1.0) if metric == "score" else (min(values), max(max(values), min(values) + 1e-6))
            ncols = min(columns, len(caches))
            nrows = math.ceil(len(caches) / ncols)
            fig, axes = plt.subplots(nrows, ncols, squeeze=False, figsize=(
                ncols * max(2.6, 0.5 * len(depths) + 1.0) + 1.0, nrows * max(2.0, 0.45 * len(lengths) + 1.3)))
            image = None
            for index, (_, label, budget) in enumerate(caches):
                ax = axes[index // ncols][index % ncols]
                sub = [r for r in recs
                       if label_of(r["policy"], r.get("params")) == label and (r.get("budget") or 0) == budget]
                grid = _heat_grid(sub, metric, lengths, depths)
                image = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
                for i, line in enumerate(grid):
                    for j, value in enumerate(line):
                        if not math.isnan(value):
                            dark = metric != "score" and (value - vmin) / (vmax - vmin) < 0.45
                            ax.text(j, i, f"{value:.2f}" if metric == "score" else f"{value:.1f}",
                                    ha="center", va="center", fontsize=7, color="white" if dark else "black")
                ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
                ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
                ax.set_title("full cache" if label == FULL else f"{label} @{budget}", fontsize=9)
                if index // ncols == nrows - 1 or index + ncols >= len(caches):
                    ax.set_xlabel("needle depth", fontsize=8)
                if index % ncols == 0:
                    ax.set_ylabel("context length", fontsize=8)
            for index in range(len(caches), nrows * ncols):
                axes[index // ncols][index % ncols].axis("off")
            fig.suptitle(f"{task}: {name} by context length and needle depth")
            fig.tight_layout()
            if image is not None:
                fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.025, pad=0.02, label=name)
            paths += _save(fig, out, f"needle_{task}_{suffix}", formats)
    return paths


def _position_field(records: Sequence[Record]) -> str | None:
    for r in records:
        for key, value in r.items():
            if "nll" in key and isinstance(value, list) and len(value) > 1:
                return key
    return None


def _binned_ppl(recs: Sequence[Record], key: str, bins: int) -> tuple[list[float], list[float]]:
    """Perplexity (exp of the mean NLL) in ``bins`` equal position bins, pooled over records."""
    width = max(len(r[key]) for r in recs)
    size = max(1, math.ceil(width / bins))
    sums: dict[int, list[float]] = defaultdict(list)
    for r in recs:
        for pos, nll in enumerate(r[key]):
            if isinstance(nll, int | float) and math.isfinite(nll):
                sums[pos // size].append(float(nll))
    xs = sorted(sums)
    return [(b + 0.5) * size for b in xs], [math.exp(sum(sums[b]) / len(sums[b])) for b in xs]


def plot_perplexity(records: Sequence[Record], out: Path, formats: Sequence[str] = FORMATS,
                    bins: int = POSITION_BINS) -> list[Path]:
    """``perplexity_<task>``: perplexity vs position (or vs context length without per-position data)."""
    paths: list[Path] = []
    ppl_records = [r for r in records if metric_value(r, "ppl") is not None or metric_value(r, "nll") is not None]
    colors = _colors(label_of(r["policy"], r.get("params")) for r in ppl_records if r["policy"] != FULL)
    for task in dict.fromkeys(r["task"] for r in ppl_records):
        recs = [r for r in ppl_records if r["task"] == task]
        key = _position_field(recs)
        budgets = sorted({r["budget"] for r in recs if r.get("budget") is not None}) or [None]
        lengths = sorted({int(r["length"]) for r in recs}) if key else [None]
        fig, axes = plt.subplots(len(lengths), len(budgets), squeeze=False,
                                 figsize=(4.4 * len(budgets) + 1.2, 3.2 * len(lengths)))
        for i, length in enumerate(lengths):
            for j, budget in enumerate(budgets):
                ax = axes[i][j]
                here = [r for r in recs if length is None or int(r["length"]) == length]
                full = [r for r in here if r["policy"] == FULL]
                series = [("full cache", full, "black", "--")]
                for label in sorted(colors):
                    sub = [r for r in here if r["policy"] != FULL and r.get("budget") == budget
                           and label_of(r["policy"], r.get("params")) == label]
                    series.append((label, sub, colors[label], "-"))
                for label, sub, color, style in series:
                    if not sub:
                        continue
                    if key:
                        xs, ys = _binned_ppl([r for r in sub if isinstance(r.get(key), list) and r[key]], key, bins)
                    else:
                        by_len: dict[int, list[float]] = defaultdict(list)
                        for r in sub:
                            if metric_value(r, "ppl") is not None:
                                by_len[int(r["length"])].append(float(r["ppl"]))
                        xs = sorted(by_len)
                        ys = [sum(by_len[n]) / len(by_len[n]) for n in xs]
                    ax.plot(xs, ys, style, color=color, marker="" if key else "o", linewidth=1.3, label=label)
                low, high = ax.get_ylim()
                if low > 0 and high / low > 10:  # a collapsed cache: log scale keeps the rest readable
                    ax.set_yscale("log")
                ax.grid(alpha=0.3)
                where = f"{length} tokens, " if length is not None else ""
                ax.set_title(f"{where}budget {budget}" if budget is not None else where.rstrip(", "), fontsize=9)
                if i == len(lengths) - 1:
                    ax.set_xlabel("token position" if key else "context length (tokens)")
                if j == 0:
                    ax.set_ylabel("perplexity")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
        fig.suptitle(f"{task}: perplexity vs {'position' if key else 'context length'}")
        fig.tight_layout()
        paths += _save(fig, out, f"perplexity_{task}", formats)
    return paths


def plot_records(records: Sequence[Record], out_dir: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Every figure the records support; returns the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown figure format {fmt!r}; choose from {list(FORMATS)}")
    if not records:
        raise ValueError("no records to plot")
    return [
        *plot_suite_average(records, out, formats),
        *plot_budget_curves(records, out, formats),
        *plot_needle_heatmaps(records, out, formats),
        *plot_perplexity(records, out, formats),
    ]
