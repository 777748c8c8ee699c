"""The figure of ``kvsieve niah``: exact match and answer log-likelihood vs KV budget, one line per policy.

One column per context length; the full cache is a dashed horizontal line; the x axis lists the budgets
in entries per KV head, evenly spaced, with the share of the context each keeps. Needs
matplotlib (the ``plots`` extra), imported only when a figure is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_niah(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Draw :func:`kvsieve.eval.niah.summarize`'s rows to ``path`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lengths = sorted({r["context_tokens"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    cmap = plt.get_cmap("tab10")
    metrics = (("exact_match", "exact match"), ("answer_logprob", "answer log-likelihood (nats)"))
    fig, axes = plt.subplots(2, len(lengths), figsize=(5.0 * len(lengths) + 1.6, 6.4), squeeze=False)
    for col, length in enumerate(lengths):
        here = [r for r in rows if r["context_tokens"] == length]
        budgets = sorted({r["budget"] for r in here if r["budget"] is not None})
        full = next((r for r in here if r["policy"] == "full"), None)
        for row_i, (metric, label) in enumerate(metrics):
            ax = axes[row_i][col]
            if full is not None:
                ax.axhline(full[metric], color="black", linestyle="--", linewidth=1.2, label="full cache")
            slot = {b: i for i, b in enumerate(budgets)}  # evenly spaced budgets, labelled with their values
            for i, policy in enumerate(policies):
                pts = sorted((r for r in here if r["policy"] == policy), key=lambda r: r["budget"])
                ax.plot([slot[p["budget"]] for p in pts], [p[metric] for p in pts], marker="o", markersize=4,
                        color=cmap(i % 10), label=policy)
            if metric == "exact_match":
                ax.set_ylim(-0.05, 1.05)
                ax.set_title(f"passkey retrieval, {length}-token context")
                ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
            else:
                ax.set_xlabel("KV budget (entries per head; % of the full cache)")
                ax.set_xticks(range(len(budgets)), [f"{b}\n{100 * b / length:.0f}%" for b in budgets])
            if col == 0:
                ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
