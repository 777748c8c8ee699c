"""Issue 12, item 6: TrimKV / DBTrimKV vs snapkv, adakv and the full cache on held-out RULER samples.

Writes ``records.jsonl`` (one record per cell, the ``kvsieve eval`` record format; resumable: finished
samples are skipped) and ``allocation.json`` (entries per layer and KV head that ``dbtrimkv`` holds after
each prompt) into ``--output``. Samples use the evaluation seed 0; the gates were trained on seeds
1000+ (held-out by construction). Run with one thread::

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/trimkv_compare.py --lengths 2048 --samples 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvsieve import KVCache, prefill_shared
from kvsieve.eval.evaluate import evaluate_cells
from kvsieve.eval.tasks import get_task
from kvsieve.gates.pretrained import PRETRAINED_DIR
from kvsieve.models.default_model import load_default_model

TASKS = ("niah_multikey_1", "niah_multikey_2", "niah_multivalue", "niah_multiquery", "niah_single_2")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--budgets", default="64,128,256")
    parser.add_argument("--policies", default="snapkv,adakv,trimkv,dbtrimkv,dbtrimkv_untied")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="docs/results/trimkv")
    parser.add_argument("--max-minutes", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    records_path, alloc_path = out / "records.jsonl", out / "allocation.json"
    done = set()
    if records_path.exists():
        for line in records_path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["task"], r["length"], r["sample"]))
    allocation = json.loads(alloc_path.read_text()) if alloc_path.exists() else []
    model, tokenizer = load_default_model()
    shipped = {p.stem.rsplit("-", 1)[-1] for p in PRETRAINED_DIR.glob("*.json")}
    policies = [p for p in args.policies.split(",") if p in ("snapkv", "adakv") or p in shipped]
    budgets = [int(b) for b in args.budgets.split(",")]
    cells = [("full", None, None)] + [(p, b, None) for p in policies for b in budgets]
    began = time.monotonic()
    for index in range(args.samples):  # sample-major: every task gets sample 0 before any gets sample 1
        for length in (int(n) for n in args.lengths.split(",")):
            for task in args.tasks.split(","):
                if (task, length, index) in done:
                    continue
                if time.monotonic() - began > 60 * args.max_minutes:
                    print("time limit reached")
                    return
                t0 = time.monotonic()
                records = evaluate_cells(model, tokenizer, task, cells, length, index, args.seed)
                with records_path.open("a") as f:
                    for r in records:
                        f.write(json.dumps(r) + "\n")
                learned = [p for p in ("dbtrimkv", "dbtrimkv_untied") if p in policies]
                if learned and index == 0:  # where the global budget goes: one shared prompt forward
                    sample = get_task(task).make_sample(tokenizer, length, index, args.seed)
                    caches = [(p, b, KVCache(model, p, budget=b)) for p in learned for b in budgets]
                    with torch.inference_mode():
                        prefill_shared(model, torch.tensor([sample.prompt_ids]), [c for *_, c in caches],
                                       logits_to_keep=1)
                    for policy, budget, cache in caches:
                        allocation.append({"task": task, "length": length, "sample": index, "policy": policy,
                                           "budget": budget, "lengths": cache.head_lengths()[:, 0].tolist()})
                    alloc_path.write_text(json.dumps(allocation) + "\n")
                scores = {f"{r['policy']}@{r['budget']}": r["score"] for r in records}
                print(f"{task} {length} #{index}: {time.monotonic() - t0:.0f}s {scores}", flush=True)


if __name__ == "__main__":
    main()
