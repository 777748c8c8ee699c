"""``kvsieve niah`` as a ready-made sweep: the passkey grid ``length × depth × seed`` × caches, run by the
same cell machinery as ``kvsieve eval`` (:func:`kvsieve.eval.evaluate.evaluate_cells`, cell kind
``needle``), and its summary table.

Each sample of the grid is one group of cells, as a sweep worker gets it: the sample is built once
(:class:`kvsieve.eval.tasks.passkey.NiahGrid`), the full cache (transformers' ``DynamicCache``) runs
first, and every ``KVCache`` not under the ``blockwise`` schedule is filled by one shared prompt
forward. The records keep the fields ``kvsieve niah`` has always written (:data:`RECORD_FIELDS`).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.eval.evaluate import CellSpec, evaluate_cells
from kvsieve.eval.tasks.passkey import NiahGrid

#: The full cache alone (what :func:`run_niah` scores without ``caches``).
FULL_ONLY: Mapping[str, CellSpec] = {"full": ("full", None, None)}
#: The fields of a ``kvsieve niah`` record, in order (``name`` and ``context_tokens`` first).
RECORD_FIELDS = (
    "depth", "seed", "prompt_tokens", "needle_start", "needle_end", "answer", "exact_match", "contains",
    "generated", "generated_ids", "answer_logprob", "answer_logprob_per_token", "answer_token_logprobs",
    "argmax_match", "prefill_s", "decode_s_per_token", "teacher_forced_s", "kv_bytes", "prefill_shared",
)


def run_niah(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Iterable[int] = (1024, 2048, 4096),
    depths: Iterable[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    seeds: Iterable[int] = (0,),
    caches: Mapping[str, CellSpec] = FULL_ONLY,
    progress: bool = True,
    max_new_tokens: int = 8,
    on_sample: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Score every (cache name, length, depth, seed); one record per combination.

    ``caches`` maps a name (the record's ``name``) to ``(policy, budget, policy_params)``; ``("full",
    None, None)`` is the full cache. ``on_sample`` is called with every record so far after each
    sample's caches are scored (to save partial results as the run goes). Each record holds ``name``,
    ``context_tokens`` and :data:`RECORD_FIELDS`: the sample, the
    :func:`kvsieve.eval.cells.needle.score_sample` fields and ``prefill_shared`` (how many caches one
    prompt forward filled; ``prefill_s`` is that forward's time). Progress goes to stderr.
    """
    task = NiahGrid(depths=tuple(depths), max_new_tokens=max_new_tokens)
    grid = [(length, index, seed) for length in lengths for index in range(len(task.depths)) for seed in seeds]
    names, specs = list(caches), list(caches.values())
    records: list[dict[str, Any]] = []
    bar = tqdm(total=len(grid) * len(specs), file=sys.stderr, disable=not progress, desc="niah")
    with bar:
        for length, index, seed in grid:
            for name, record in zip(names, evaluate_cells(model, tokenizer, task, specs, length, index, seed),
                                    strict=True):
                records.append({"name": name, "context_tokens": length, **{k: record[k] for k in RECORD_FIELDS}})
                bar.set_postfix_str(f"{name} L={length} d={task.depths[index]}", refresh=False)
                bar.update()
            if on_sample is not None:
                on_sample(records)
    return records


def _split_name(name: str) -> tuple[str, int | None]:
    """``"snapkv@256"`` → ``("snapkv", 256)``; ``"full"`` → ``("full", None)``."""
    policy, sep, budget = name.rpartition("@")
    return (policy, int(budget)) if sep and budget.isdigit() else (name, None)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (cache, context length): mean exact match, answer log-likelihood, KV bytes held and the
    fraction of the full cache's, mean decoding seconds per token and the speed relative to the full cache."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        groups[(rec["name"], rec["context_tokens"])].append(rec)
    rows = []
    for (name, length), recs in groups.items():
        policy, budget = _split_name(name)
        kv = [r["kv_bytes"] for r in recs if r.get("kv_bytes") is not None]
        rows.append({
            "name": name,
            "policy": policy,
            "budget": budget,
            "context_tokens": length,
            "samples": len(recs),
            "exact_match": sum(r["exact_match"] for r in recs) / len(recs),
            "answer_logprob": sum(r["answer_logprob"] for r in recs) / len(recs),
            "kv_bytes": sum(kv) / len(kv) if kv else None,
            "decode_s_per_token": sum(r["decode_s_per_token"] for r in recs) / len(recs),
        })
    for row in rows:
        full = next((r for r in rows if r["name"] == "full" and r["context_tokens"] == row["context_tokens"]), None)
        has_kv = full is not None and full["kv_bytes"] and row["kv_bytes"] is not None
        row["kv_fraction"] = row["kv_bytes"] / full["kv_bytes"] if has_kv else None  # type: ignore[index]
        speed = full is not None and row["decode_s_per_token"] > 0
        row["decode_speed_vs_full"] = full["decode_s_per_token"] / row["decode_s_per_token"] if speed else None  # type: ignore[index]
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per (cache, length): budget, KV held, exact match, log-likelihood, decoding speed vs full.

    Rows are grouped by context length, the full cache first, then policy by policy in ascending budget.
    """
    order = {name: i for i, name in enumerate(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))}
    ranked = sorted(rows, key=lambda r: (r["context_tokens"], r["policy"] != "full", order.get(r["policy"], -1),
                                         r["budget"] or 0))
    width = max(12, *(len(r["policy"]) for r in rows)) + 1
    head = (f"{'policy':<{width}} {'tokens':>6} {'budget':>6} {'KV MiB':>7} {'% full':>6} {'EM':>5} "
            f"{'logp':>7} {'ms/tok':>7} {'speed':>6}")
    lines = [head, "-" * len(head)]
    previous = None
    for r in ranked:
        if previous is not None and r["policy"] != previous:
            lines.append("")
        previous = r["policy"]
        kv = "" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 2**20:7.2f}"
        frac = "" if r["kv_fraction"] is None else f"{100 * r['kv_fraction']:5.1f}%"
        speed = "" if r["decode_speed_vs_full"] is None else f"{r['decode_speed_vs_full']:5.2f}x"
        lines.append(
            f"{r['policy']:<{width}} {r['context_tokens']:>6} {'-' if r['budget'] is None else r['budget']:>6} "
            f"{kv:>7} {frac:>6} {100 * r['exact_match']:4.0f}% {r['answer_logprob']:7.2f} "
            f"{1000 * r['decode_s_per_token']:7.1f} {speed:>6}"
        )
    return "\n".join(lines)
