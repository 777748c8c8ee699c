"""The benchmark figure: six panels vs context length, colour = cache, line style = batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

MIB = 1024 * 1024
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")
#: (summary field, panel title, scale factor, log y)
PANELS = (
    ("decode_tokens_per_s", "decoding throughput (tokens/s)", 1.0, False),
    ("latency_ms_median", "per-token latency, median (ms)", 1.0, False),
    ("prefill_s", "prefill + compression (s)", 1.0, False),
    ("kv_bytes", "KV bytes held after decoding (MiB)", 1 / MIB, True),
    ("decode_peak_rss_bytes", "process peak RSS while decoding (MiB)", 1 / MIB, False),
    ("decode_tokens_per_s_ratio", "decoding speed-up over the full cache", 1.0, False),
)


def plot_bench(result: dict[str, Any], stem: str | Path, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Write ``<stem>.png`` and ``<stem>.svg`` from a :func:`kvsieve.bench.runner.run_bench` result."""
    rows = result["summary"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    cmap = plt.get_cmap("tab10")
    colors = {label: ("black" if label == "full" else cmap((i - 1) % 10)) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, title, scale, log) in zip(axes.ravel(), PANELS, strict=True):
        for label in labels:
            if name.endswith("_ratio") and label == "full":
                continue
            for bi, batch in enumerate(batches):
                pts = sorted(
                    (r for r in rows if r["label"] == label and r["batch"] == batch and r.get(name) is not None),
                    key=lambda r: r["length"],
                )
                if name == "prefill_s" and bi > 0:
                    continue  # prefill is batch 1 for every batch size
                if pts:
                    ax.plot([p["length"] for p in pts], [p[name] * scale for p in pts], STYLES[bi % 4],
                            marker=MARKERS[bi % 4], markersize=4, color=colors[label])
        if name.endswith("_ratio"):
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("context length (tokens)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colors[label], label=label) for label in labels]
    handles += [Line2D([], [], color="gray", linestyle=STYLES[i % 4], marker=MARKERS[i % 4], label=f"batch {b}")
                for i, b in enumerate(batches)]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    meta = result.get("meta", {})
    fig.suptitle(f"kvsieve bench: {meta.get('model', '')} {meta.get('dtype', '')}, {meta.get('threads', '')} "
                 f"thread(s), budget {meta.get('budget', '')} entries per KV head")
    fig.tight_layout()
    paths = []
    for fmt in formats:
        path = Path(f"{stem}.{fmt}")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths
