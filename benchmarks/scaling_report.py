"""How prefill, decoding-step time and memory grow with prompt length and batch: one table and one figure
from several ``kvsieve bench`` JSON files (issue 22, item 4).

Each input is a ``kvsieve bench`` result (e.g. one run for 1k–4k, one for 8k, one for 16k on
``benchmarks/beyond_context_model.py``); their summary rows are merged (a later file's row replaces an
earlier one for the same length, batch and cache). Writes ``<output>.md`` (per length: prefill at batch 1,
decoding step per batch, each with its ratio to the full cache — transformers' ``DynamicCache`` — and the KV
MiB held) and ``<output>.png``/``.svg`` (``kvsieve bench``'s six panels over every length).

Usage: ``python benchmarks/scaling_report.py bench.json bench_8k.json bench_16k.json --output scaling``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsieve.bench.plot import plot_bench

MIB = 2**20


def merge(paths: Sequence[Path]) -> dict[str, Any]:
    """One bench result whose summary holds every file's rows (later files win on a repeated row)."""
    rows: dict[tuple[int, int, str], dict[str, Any]] = {}
    metas = []
    for path in paths:
        result = json.loads(path.read_text())
        meta = dict(result["meta"])
        meta["file"] = path.name
        metas.append(meta)
        for row in result["summary"]:
            rows[(row["length"], row["batch"], row["label"])] = dict(row, model=meta["model"], file=path.name)
    first = dict(metas[0])
    first["model"] = " + ".join(dict.fromkeys(m["model"] for m in metas))
    return {"meta": first, "sources": metas, "summary": sorted(rows.values(), key=lambda r: (r["length"], r["batch"]))}


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per (length, cache); prefill at batch 1 and the decoding step at every batch."""
    rows = result["summary"]
    batches = sorted({r["batch"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in sorted(rows, key=lambda r: r["label"] != "full")))
    head = ["length", "cache", "prefill s (b1)", "÷ full"]
    for batch in batches:
        head += [f"step ms b{batch}", "÷ full"]
    head += ["KV MiB (b1)", "peak entries/head"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for length in sorted({r["length"] for r in rows}):
        for label in labels:
            by_batch = {r["batch"]: r for r in rows if r["length"] == length and r["label"] == label}
            if not by_batch:
                continue
            first = by_batch[min(by_batch)]
            cells = [str(length), label, f"{first['prefill_s']:.2f}", f"{first['prefill_s_ratio']:.2f}"]
            for batch in batches:
                r = by_batch.get(batch)
                cells += ["—", "—"] if r is None else [f"{r['latency_ms_median']:.1f}",
                                                       f"{r['latency_ms_median_ratio']:.2f}"]
            cells += [f"{first['kv_bytes'] / MIB:.1f}", str(int(first["peak_head_length"]))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="kvsieve bench JSON files")
    parser.add_argument("--output", type=Path, required=True, help="stem of the .md/.png/.svg/.json written")
    args = parser.parse_args(argv)
    result = merge(args.inputs)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    sources = "\n".join(f"* `{m['file']}`: model `{m['model']}`, lengths {m['lengths']}, batches {m['batches']}, "
                        f"{m['dtype']}, {m['threads']} thread(s), budget {m['budget']}, torch {m['torch']}"
                        for m in result["sources"])
    text = (f"# Scaling: prefill, decoding step and memory vs prompt length and batch\n\nSources:\n{sources}\n\n"
            "Ratios are to the full cache (transformers' `DynamicCache`) of the same run; prefill at batch 1 "
            "(the decoding batches replicate the prefilled cache).\n\n" + table(result) + "\n")
    args.output.with_suffix(".md").write_text(text)
    args.output.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot_bench(result, args.output)
    print(text)


if __name__ == "__main__":
    main()
