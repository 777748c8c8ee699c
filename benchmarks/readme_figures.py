"""The README's figures from recorded results (no model run): PNGs under ``docs/results/figures/``.

* ``needle_heatmap.png`` — from a ``kvsieve niah`` JSON: one panel per policy, KV budget × needle depth,
  colour = answer log-likelihood of the pass key, text = exact-match rate (the full cache as top row).
* ``speed_memory_vs_context.png`` — from a ``kvsieve bench`` JSON: decoding tokens/s (one line per cache
  and batch size) and KV MiB held vs context length.

Usage::

    python benchmarks/readme_figures.py --niah docs/results/issue13/niah_demo.json \\
        --bench docs/results/issue13/bench_context.json --output docs/results/figures
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MIB = 2**20


def _split(name: str) -> tuple[str, int | None]:
    policy, sep, budget = name.rpartition("@")
    return (policy, int(budget)) if sep and budget.isdigit() else (name, None)


def needle_heatmap(niah: dict[str, Any], path: Path) -> Path:
    """Budget × depth per policy (the full cache as the top row): colour = mean answer log-likelihood,
    text = exact match."""
    cells: dict[tuple[str, int | None, float], list[dict[str, Any]]] = defaultdict(list)
    for rec in niah["records"]:
        policy, budget = _split(rec["name"])
        cells[(policy, budget, round(rec["depth"], 3))].append(rec)
    policies = [p for p in dict.fromkeys(p for p, _, _ in cells) if p != "full"]
    depths = sorted({d for _, _, d in cells})
    values = [sum(r["answer_logprob"] for r in v) / len(v) for v in cells.values()]
    vmin, vmax = min(values), max(values)
    fig, axes = plt.subplots(1, len(policies), figsize=(2.3 * len(policies) + 1.5, 3.6), squeeze=False,
                             sharey=False)
    image = None
    for ax, policy in zip(axes[0], policies, strict=True):
        budgets: list[int | None] = sorted(b for p, b, _ in set(cells) if p == policy and b is not None)
        budgets = [*sorted(set(budgets)), None]  # the full cache as the top row of every panel
        grid = [[math.nan] * len(depths) for _ in budgets]
        for i, budget in enumerate(budgets):
            for j, depth in enumerate(depths):
                recs = cells.get(("full", None, depth) if budget is None else (policy, budget, depth), [])
                if not recs:
                    continue
                grid[i][j] = sum(r["answer_logprob"] for r in recs) / len(recs)
                em = sum(r["exact_match"] for r in recs) / len(recs)
                dark = (grid[i][j] - vmin) / (vmax - vmin + 1e-9) < 0.45
                ax.text(j, i, f"{100 * em:.0f}%", ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
        image = ax.imshow(grid, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(budgets)), ["full" if b is None else str(b) for b in budgets], fontsize=7)
        ax.set_title(policy, fontsize=9)
        ax.set_xlabel("needle depth", fontsize=8)
    axes[0][0].set_ylabel("KV budget (entries per head)", fontsize=8)
    lengths = sorted({r["context_tokens"] for r in niah["records"]})
    fig.suptitle(f"passkey retrieval, {'/'.join(map(str, lengths))} tokens, {niah.get('model', '')}: "
                 "colour = answer log-likelihood, text = exact match", fontsize=10)
    fig.tight_layout()
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), fraction=0.02, pad=0.01, label="answer log-likelihood")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def speed_memory(bench: dict[str, Any], path: Path) -> Path:
    """Decoding tokens/s and KV MiB held vs context length, per cache (and batch size for speed)."""
    rows = bench["summary"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    cmap = plt.get_cmap("tab10")
    colors = {label: "black" if label == "full" else cmap(i % 10) for i, label in enumerate(labels)}
    styles = ("-", "--", ":", "-.")
    fig, (speed_ax, mem_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    markers = ("o", "s", "^", "D", "v")
    for li, label in enumerate(labels):
        for bi, batch in enumerate(batches):
            pts = sorted((r for r in rows if r["label"] == label and r["batch"] == batch), key=lambda r: r["length"])
            speed_ax.plot([p["length"] for p in pts], [p["decode_tokens_per_s"] for p in pts], styles[bi % 4],
                          marker="o", markersize=4, color=colors[label], label=f"{label}, batch {batch}")
        pts = sorted((r for r in rows if r["label"] == label and r["batch"] == batches[0]), key=lambda r: r["length"])
        mem_ax.plot([p["length"] for p in pts], [p["kv_bytes"] / MIB / batches[0] for p in pts],
                    marker=markers[li % len(markers)], markersize=7 - 2 * (li % 2), linestyle=styles[li % 4],
                    color=colors[label], label=label)  # equal-memory caches overlap: markers tell them apart
    lengths = sorted({r["length"] for r in rows})
    for ax, title in ((speed_ax, "decoding throughput (tokens/s)"), (mem_ax, "KV cache held per sequence (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    mem_ax.set_ylim(bottom=0)
    speed_ax.legend(fontsize=7, frameon=False)
    mem_ax.legend(fontsize=7, frameon=False)
    meta = bench.get("meta", {})
    fig.suptitle(f"{meta.get('model', '')} {meta.get('dtype', '')}, {meta.get('threads', '')} thread(s), "
                 f"budget {meta.get('budget', '')} entries per KV head", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--niah", help="a kvsieve niah JSON")
    parser.add_argument("--bench", help="a kvsieve bench JSON")
    parser.add_argument("--output", default="docs/results/figures")
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.niah:
        print(needle_heatmap(json.loads(Path(args.niah).read_text()), out / "needle_heatmap.png"))
    if args.bench:
        print(speed_memory(json.loads(Path(args.bench).read_text()), out / "speed_memory_vs_context.png"))


if __name__ == "__main__":
    main()
