"""Why does EMS lose the passkey at 8k? Needle retention and the two terms of its score (issue 24, item 4).

For passkey prompts (``passkey`` task: five depths) at each length, on the default model:

1. **Needle held after the prefill** under ``ems``, its ablations (``tau=1``: no merge; ``use_global=False``:
   the local term alone; ``schedule=prefill``: no decoding-time eviction), ``ems_pos``, ``restkv`` and
   ``snapkv``: the mean share of the pass key's tokens (its digits, both occurrences in the needle) a (layer,
   KV head) holds as entries, and, for ``ems_pos``, also through a centre's position table (merged into it).
2. **The score's terms**, from an ``ems`` cache large enough to evict nothing (the side data of the whole
   prompt): per (layer, KV head), the rank of the pass key's best token under Eq. 2 and under each term alone
   (``g·mean(s_loc)/mean(s_glo)`` vs ``s_loc``), and how many of the top ``budget − window`` entries the global
   term puts there (entries whose global term exceeds their local term).

Writes ``benchmarks/results/ems_long_context.json``. Usage: ``python benchmarks/ems_long_context.py
[--lengths 4096,8192] [--samples 5] [--budget 256] [--dtype bfloat16] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_overhead import cpu_info

RESULTS = Path(__file__).parent / "results" / "ems_long_context.json"
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ems": ("ems", {}),
    "ems_tau1": ("ems", {"tau": 1.0}),
    "ems_local_only": ("ems", {"use_global": False}),
    "ems_prefill_schedule": ("ems", {"schedule": "prefill"}),
    "ems_pos": ("ems_pos", {}),
    "restkv": ("restkv", {}),
    "snapkv": ("snapkv", {}),
}


def passkey_span(sample: Any, tokenizer: Any) -> list[int]:
    """Positions of the prompt tokens that spell the pass key (digits inside the needle's span)."""
    start, end = sample.meta["needle_start"], sample.meta["needle_end"]
    key = sample.references[0]
    digits = [i for i in range(start, end) if any(ch.isdigit() for ch in tokenizer.decode([sample.prompt_ids[i]]))]
    assert digits and "".join(tokenizer.decode([sample.prompt_ids[i]]).strip() for i in digits).find(key[:2]) >= 0
    return digits


def held_share(cache: Any, span: list[int], table: bool) -> float:
    """Mean share of the pass-key tokens a (layer, KV head) holds (as an entry, or in a position table)."""
    from kvsieve.parts.actions.evict_merge_pos import POSITION_TABLE

    wanted = torch.tensor(span)
    hits, total = 0.0, 0
    for layer in cache.layers:
        store = layer.store
        if store is None or layer.left_alone:
            continue
        view = store.dense()
        for head in range(view.positions.shape[1]):
            valid = torch.ones_like(view.positions[0, head], dtype=torch.bool)
            if view.valid is not None:
                valid = view.valid[0, head]
            held = set(view.positions[0, head][valid].tolist())
            if table and POSITION_TABLE in view.extras:
                merged = view.extras[POSITION_TABLE][0, head][valid]
                held |= {int(p) for p in merged.flatten().tolist() if p >= 0}
            hits += sum(int(p) in held for p in wanted) / len(wanted)
            total += 1
    return hits / max(total, 1)


def term_ranks(cache: Any, span: list[int], budget: int, window: int) -> dict[str, float]:
    """From a cache that evicted nothing: ranks of the pass key's best token under Eq. 2 and each term."""
    from kvsieve.parts.scorers.global_local import GLOBAL, LOCAL_CUR, LOCAL_PAST

    ranks: dict[str, list[int]] = {"combined": [], "global_term": [], "local_term": []}
    global_wins_top: list[float] = []
    for layer in cache.layers:
        store = layer.store
        if store is None or layer.left_alone:
            continue
        view = store.dense()
        g = view.extras[GLOBAL][0].float()
        loc = (view.extras[LOCAL_PAST][0] + view.extras[LOCAL_CUR][0]).float()
        n = g.shape[-1]
        prefix = n - window  # the protected window is kept anyway
        ratio = loc.sum(-1, keepdim=True) / g.sum(-1, keepdim=True)
        g_scaled = g * ratio
        combined = torch.maximum(g_scaled, loc)
        for name, score in (("combined", combined), ("global_term", g_scaled), ("local_term", loc)):
            order = score[:, :prefix].argsort(dim=-1, descending=True).argsort(dim=-1)  # rank of each entry
            ranks[name] += order[:, span].amin(dim=-1).tolist()  # the best-ranked pass-key token
        top = combined[:, :prefix].topk(budget - window, dim=-1).indices
        wins = (g_scaled[:, :prefix] > loc[:, :prefix]).gather(-1, top).float().mean(dim=-1)
        global_wins_top += wins.tolist()
    keep = budget - window
    out = {f"{name}_median_rank": statistics.median(v) for name, v in ranks.items()}
    out |= {f"{name}_kept_share": sum(r < keep for r in v) / len(v) for name, v in ranks.items()}
    out["global_term_share_of_top"] = statistics.fmean(global_wins_top)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import kvsieve
    from kvsieve.eval.tasks import get_task

    model, tokenizer = kvsieve.load_default_model(dtype=getattr(torch, args.dtype))
    task = get_task("passkey")
    rows = []
    started = time.perf_counter()
    for length in [int(x) for x in args.lengths.split(",")]:
        for index in range(args.samples):
            sample = task.make_sample(tokenizer, length, index, 0)
            span = passkey_span(sample, tokenizer)
            ids = torch.tensor([sample.prompt_ids])
            row: dict[str, Any] = {"length": length, "sample": index, "depth": sample.meta["depth"],
                                   "passkey_tokens": len(span)}
            with torch.no_grad():
                for label, (name, params) in VARIANTS.items():
                    cache = kvsieve.KVCache(model, name, budget=args.budget, **params)
                    model(ids, **kvsieve.cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
                    cache.flush()
                    row[f"held_{label}"] = held_share(cache, span, table=name == "ems_pos")
                probe = kvsieve.KVCache(model, "ems", budget=len(sample.prompt_ids) + 64, schedule="prefill")
                model(ids, **kvsieve.cache_kwargs(model, probe), use_cache=True, logits_to_keep=1)
                row |= term_ranks(probe, span, args.budget, 32)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary: dict[str, dict[str, float]] = {}
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        keys = [k for k in mine[0] if k.startswith("held_") or k.endswith(("_rank", "_share", "_of_top"))]
        summary[str(length)] = {k: statistics.fmean(r[k] for r in mine) for k in keys}
    out = {"benchmark": "ems_long_context", "budget": args.budget, "dtype": args.dtype, "threads": args.threads,
           "cpu": cpu_info(), "torch": torch.__version__, "seconds": time.perf_counter() - started,
           "summary": summary, "rows": rows}
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
