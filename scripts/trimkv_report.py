"""Tables and the allocation figure of ``docs/results/trimkv`` from ``records.jsonl`` and ``allocation.json``.

    PYTHONPATH=src python scripts/trimkv_report.py docs/results/trimkv
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def tables(records: list[dict]) -> str:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        cells[(r["length"], r["task"], r["policy"], r["budget"])].append(r)
    lines = []
    lengths = sorted({k[0] for k in cells})
    tasks = sorted({k[1] for k in cells})
    order = ["full", "snapkv", "adakv", "trimkv", "dbtrimkv", "dbtrimkv_untied"]
    for length in lengths:
        rows = sorted({(k[2], k[3]) for k in cells if k[0] == length},
                      key=lambda pb: (pb[1] or 0, order.index(pb[0]) if pb[0] in order else 99))
        n = {len(cells[(length, t, *rows[0])]) for t in tasks if (length, t, *rows[0]) in cells}
        lines.append(f"\n### {length} tokens (samples per task: {sorted(n)})\n")
        lines.append("Score (RULER string match, mean over samples) per task; then the mean over tasks, the mean "
                     "answer log-likelihood gap to the full cache (nats, lower = closer) and the mean KL(full ‖ "
                     "policy) over answer tokens.\n")
        lines.append("| policy | budget/head | " + " | ".join(tasks) + " | mean score | Δ log-lik | KL |")
        lines.append("|---|---|" + "---|" * (len(tasks) + 3))
        for policy, budget in rows:
            per_task, gaps, kls = [], [], []
            for task in tasks:
                rs = cells.get((length, task, policy, budget), [])
                per_task.append(_mean([r["score"] for r in rs]))
                gaps += [r["logprob_gap"] for r in rs]
                kls += [r["kl_full_compressed"] for r in rs]
            lines.append(f"| {policy} | {budget if budget else '—'} | " + " | ".join(f"{s:.2f}" for s in per_task)
                         + f" | {_mean(per_task):.3f} | {_mean(gaps):.3f} | {_mean(kls):.4f} |")
    return "\n".join(lines)


def allocation_figure(allocation: list[dict], folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    for policy, length in sorted({(a["policy"], a["length"]) for a in allocation}):
        mine = [a for a in allocation if a["policy"] == policy and a["length"] == length]
        budgets = sorted({a["budget"] for a in mine})
        fig, axes = plt.subplots(1, len(budgets), figsize=(3.2 * len(budgets), 6), squeeze=False)
        for ax, budget in zip(axes[0], budgets, strict=True):
            mats = [np.array(a["lengths"]) for a in mine if a["budget"] == budget]
            mean = np.mean(mats, axis=0)  # (layers, heads)
            im = ax.imshow(mean, aspect="auto", cmap="viridis")
            ax.set_title(f"{policy} M={budget}\n(uniform would be {budget})", fontsize=9)
            ax.set_xlabel("KV head")
            ax.set_ylabel("layer")
            fig.colorbar(im, ax=ax, fraction=0.08)
        fig.suptitle(f"Entries held per layer and KV head after a {length}-token prompt ({policy}, mean over "
                     f"{len(mine) // len(budgets)} prompts)", fontsize=10)
        fig.tight_layout()
        path = folder / f"allocation_{policy}_{length}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


def allocation_table(allocation: list[dict]) -> str:
    import numpy as np

    lines = ["| policy | tokens | M | min head | max head | heads < M/4 "
             "| share of total in layers 0–9 / 10–19 / 20–29 |",
             "|---|---|---|---|---|---|---|"]
    for policy, length in sorted({(a["policy"], a["length"]) for a in allocation}):
        mine = [a for a in allocation if a["policy"] == policy and a["length"] == length]
        for budget in sorted({a["budget"] for a in mine}):
            mats = np.array([a["lengths"] for a in mine if a["budget"] == budget])
            mean = mats.mean(axis=0)
            total = mean.sum()
            thirds = [mean[i:i + 10].sum() / total for i in (0, 10, 20)]
            lines.append(f"| {policy} | {length} | {budget} | {mats.min()} | {mats.max()} | "
                         f"{(mean < budget / 4).mean():.0%} | " + " / ".join(f"{t:.0%}" for t in thirds) + " |")
    return "\n".join(lines)


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/trimkv")
    records = [json.loads(x) for x in (folder / "records.jsonl").read_text().splitlines()]
    text = tables(records)
    alloc_path = folder / "allocation.json"
    if alloc_path.exists():
        allocation = json.loads(alloc_path.read_text())
        text += "\n\n### Where the global budget goes\n\n" + allocation_table(allocation)
        text += "\n\n" + "\n".join(f"![{n}]({n})" for n in allocation_figure(allocation, folder))
    (folder / "tables.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
