"""Argument parsing and entry points of ``kvsieve eval`` and ``kvsieve plot``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvsieve.eval.results import RECORDS_FILE
from kvsieve.eval.sweep_config import BACKENDS, CONFIG_KEYS, build_config, load_config_file
from kvsieve.models.arguments import add_model_arguments
from kvsieve.models.loading import IMPORT_PATH


def _list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvsieve eval``; every one defaults to None so a ``--config`` file can supply it."""
    parser.add_argument("--config", help="YAML sweep file (same keys as these flags); flags override it")
    parser.add_argument("--policies", type=_list,
                        help="comma-separated policies, parameters after colons: snapkv,h2o:schedule=blockwise "
                             "(the full cache always runs as reference)")
    parser.add_argument("--budgets", type=_list, help="entries per KV head, e.g. 64,128")
    parser.add_argument("--tasks", type=_list, help="e.g. niah_single_1,vt")
    parser.add_argument("--lengths", type=_list, help="context lengths in tokens, e.g. 2048,4096")
    parser.add_argument("--samples", type=int, help="samples per (task, length) (default 1)")
    parser.add_argument("--seed", type=int, help="sweep seed (default 0)")
    parser.add_argument("--output-dir", help="folder of records.jsonl and the summaries (default results/eval)")
    parser.add_argument("--workers", type=int, help="parallel worker processes (default min(2, cpu count))")
    parser.add_argument("--threads", type=int, help="torch threads per worker (default cpu count / workers)")
    parser.add_argument("--backend", choices=BACKENDS, help="local processes (default) or Ray tasks")
    parser.add_argument("--address", help="Ray cluster address (default: start a local Ray instance)")
    add_model_arguments(parser, with_defaults=False, with_tokenizer=False)
    parser.add_argument("--trust-config-code", action="store_true",
                        help="let the --config file's model be a package.module:function to import and call "
                             "(a sweep file naming a function is code: refused without this flag)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_values(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML file's settings overridden by every flag given on the command line."""
    values: dict[str, Any] = load_config_file(args.config) if args.config else {}
    values = {key.replace("-", "_"): value for key, value in values.items()}
    model = values.get("model")
    if (isinstance(model, str) and IMPORT_PATH.match(model) and args.model is None
            and not getattr(args, "trust_config_code", False)):
        raise ValueError(
            f"--config: {args.config} names model {model!r}, a function kvsieve would import and call: a sweep "
            "file naming a function is code. Pass --trust-config-code if you trust this file, or --model"
        )
    for key in CONFIG_KEYS:
        flag = getattr(args, key, None)
        if flag is not None:
            values[key] = flag
    return values


def run_eval_command(args: argparse.Namespace) -> int:
    """Validate, run (resuming), print the summary; exit status 1 if any cell failed."""
    from kvsieve.eval.runner import run_sweep

    config = build_config(config_values(args))
    outcome = run_sweep(config, progress=not args.no_progress)
    out = outcome.output_dir
    print((out / "summary.md").read_text(encoding="utf-8"))
    print(f"kvsieve eval: {outcome.ran} cells run, {outcome.skipped} already done, {outcome.failed} failed; "
          f"records in {out / RECORDS_FILE}, summaries in {out / 'summary.md'} and {out / 'summary.csv'}",
          file=sys.stderr)
    return 1 if outcome.failed else 0


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvsieve plot``."""
    parser.add_argument("records", help="a sweep's records.jsonl, or its output folder")
    parser.add_argument("--output", help="figure folder (default: plots/ beside the records)")
    parser.add_argument("--formats", type=_list, default=["png", "svg"], help="png,svg (default both)")


def run_plot_command(args: argparse.Namespace) -> int:
    """Read the records and write every figure they support."""
    from kvsieve.eval.plots import plot_records
    from kvsieve.eval.results import read_records

    path = Path(args.records)
    if path.is_dir():
        path = path / RECORDS_FILE
    if not path.is_file():
        raise ValueError(f"no records file at {path}")
    out = Path(args.output) if args.output else path.parent / "plots"
    written = plot_records(read_records(path), out, args.formats)
    for item in written:
        print(item)
    print(f"kvsieve plot: {len(written)} files in {out}", file=sys.stderr)
    return 0
