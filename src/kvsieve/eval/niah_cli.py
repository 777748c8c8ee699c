"""``kvsieve niah``: the passkey comparison (full cache, baselines, the papers' methods) over a range of
budgets, as a table, a JSON file and a plot of exact match and answer log-likelihood vs budget.

The command checks every flag before the model loads, warms the model up (untimed) and runs the
ready-made sweep :func:`kvsieve.eval.niah.run_niah`, rewriting the JSON after every sample.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from typing import Any

import torch

from kvsieve.eval.evaluate import CellSpec
from kvsieve.eval.niah import format_table, run_niah, summarize
from kvsieve.eval.tasks.passkey import NiahGrid
from kvsieve.policies.presets import make_policy
from kvsieve.policies.spec import parse_policy_spec
from kvsieve.result_files import check_output_file, cpu_info, write_json_atomic
from kvsieve.transformers_adapter import cache_kwargs

#: Shortest ``--lengths`` accepted: the passkey prompt's fixed parts take ~70 tokens of any common tokenizer.
MIN_CONTEXT_TOKENS = NiahGrid.min_length


def _warm_up(model: Any, caches: list[Any]) -> None:
    """A short prefill and two decoding steps on a full and a compressed cache, untimed, so the first
    timed cache does not pay for first-call set-up (kernel selection, allocator growth)."""
    from transformers import DynamicCache

    ids = torch.arange(3, 67, device=model.device)[None]
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing was compressed": the warm-up prompt may fit the budget
        for cache in [DynamicCache(config=model.config), *caches]:
            token = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
            for _ in range(2):
                token = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)


def run_niah_command(args: argparse.Namespace) -> int:
    """Validate everything, load the default model, run the grid, print and save results."""
    # Validate every policy/budget before loading anything.
    parsed = {p: parse_policy_spec(p) for p in args.policies if p != "full"}
    caches: dict[str, CellSpec] = {"full": ("full", None, None)}
    caches.update({f"{p}@{b}": (name, b, params) for p, (name, params) in parsed.items() for b in args.budgets})
    built = {key: make_policy(name, budget=b, **(params or {})) for key, (name, b, params) in caches.items()
             if key != "full"}
    for length in args.lengths:
        if length < MIN_CONTEXT_TOKENS:
            raise ValueError(f"--lengths: each context length must be ≥ {MIN_CONTEXT_TOKENS} tokens (the passkey "
                             f"prompt's instructions, needle and question take ~70 tokens); got {length}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be ≥ 1; got {args.max_new_tokens}")
    out = check_output_file(args.output)
    for depth in args.depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"--depths: each depth must be in [0, 1]; got {depth}")

    from kvsieve.engine.kv_cache import KVCache
    from kvsieve.models.arguments import check_model_args, load_model_from_args
    from kvsieve.policies.model_check import check_policies_for_model

    check_model_args(args)
    check_policies_for_model(args, list(built.values()))
    started, cpu_started, load_before = time.perf_counter(), time.process_time(), os.getloadavg()
    model, tokenizer = load_model_from_args(args)

    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(args.lengths) + args.max_new_tokens > limit:
        raise ValueError(f"--lengths: {max(args.lengths)} tokens + {args.max_new_tokens} new exceed the model's "
                         f"{limit} positions (max_position_embeddings)")
    _warm_up(model, [KVCache(model, p) for p in list(built.values())[:1]])
    def payload(records: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        return {
            "task": "niah_passkey",
            "complete": complete,
            "model": "SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model,
            "dtype": args.dtype,
            "policies": {name: str(policy) for name, policy in built.items()},
            "lengths": args.lengths, "depths": args.depths, "seeds": args.seeds,
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpu": cpu_info(), "wall_s": wall_s, "cpu_s": cpu_s,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "summary": summarize(records),
            "records": [{k: v for k, v in r.items() if k != "generated_ids"} for r in records],
        }

    records = run_niah(
        model, tokenizer, lengths=args.lengths, depths=args.depths, seeds=args.seeds,
        caches=caches, progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
        on_sample=lambda so_far: write_json_atomic(out, payload(so_far, complete=False)),
    )
    final = payload(records, complete=True)
    write_json_atomic(out, final)
    rows = final["summary"]
    print(format_table(rows))
    print(f"EM: exact match; logp: teacher-forced log-likelihood of the pass key (nats, higher is better); "
          f"speed: decoding tokens/s vs the full cache; {len(args.depths) * len(args.seeds)} samples per row; "
          f"{final['wall_s'] / 60:.1f} min ({final['cpu_s'] / 60:.1f} CPU min) with {torch.get_num_threads()} "
          "torch threads")
    print(f"results: {out}")
    if not args.no_plot:
        from kvsieve.eval.niah_plot import plot_niah

        try:
            figure = plot_niah(rows, out.with_suffix(".png"))
        except ImportError:
            print("no plot: matplotlib is not installed (pip install 'kvsieve[plots]')", file=sys.stderr)
        else:
            print(f"plot: {figure}")
    return 0
