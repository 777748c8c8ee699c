"""``kvsieve tune``: flags and entry point (the search itself is :mod:`kvsieve.tune.study`)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from kvsieve.models.arguments import add_model_arguments
from kvsieve.models.loading import MissingExtraError
from kvsieve.tune.calibration import DEFAULT_TASKS, CalibrationSet
from kvsieve.tune.space import ACTIONS, ALLOCATORS, SCHEDULES, default_choices

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")


def parse_duration(text: str) -> float:
    """``"90"``/``"90s"`` → 90, ``"30m"`` → 1800, ``"2h"`` → 7200 seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"--time-limit: expected seconds or a number with s/m/h (30m); got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def _list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in _list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, with_tokenizer=False)
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", type=int, help="memory budget: entries per KV head (as every policy's budget)")
    budget.add_argument("--budget-bytes", type=int,
                        help="memory budget: bytes of keys and values per KV head (converted to the entries of the "
                             "model's dtype and head size those bytes hold)")
    parser.add_argument("--time-limit", type=parse_duration, help="stop starting trials after this long (30m, 2h)")
    parser.add_argument("--trials", type=int, help="number of trials (default 40 without --time-limit)")
    parser.add_argument("--tasks", type=_list, default=list(DEFAULT_TASKS), help="calibration tasks")
    parser.add_argument("--lengths", type=_ints, default=[2048], help="calibration lengths in tokens")
    parser.add_argument("--samples", type=int, default=2, help="calibration samples per task and length")
    parser.add_argument("--calibration-seed", type=int, default=1_000_000,
                        help="sweep seed of the calibration samples (1000000–1999999: calibration essays only)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed (the search is deterministic in it)")
    parser.add_argument("--batch", type=int, default=4,
                        help="trials evaluated together (one shared prompt forward per sample for all of them)")
    parser.add_argument("--prune-after", type=int, default=6,
                        help="calibration samples a trial runs before the median pruner may stop it")
    parser.add_argument("--scorers", type=_list, help="scorers to search (default: every one but kvzip, retention)")
    parser.add_argument("--allocators", type=_list, help=f"allocators to search (default: {', '.join(ALLOCATORS)})")
    parser.add_argument("--actions", type=_list, help=f"actions to search (default: {', '.join(ACTIONS)})")
    parser.add_argument("--schedules", type=_list, help=f"schedules to search (default: {', '.join(SCHEDULES)})")
    parser.add_argument("--baselines", type=_list,
                        help="presets evaluated on the calibration set for the report (default: the seed methods "
                             "and baselines)")
    parser.add_argument("--name", help="name of the preset written (default tuned_b<budget>)")
    parser.add_argument("--output-dir", default="results/tune",
                        help="folder of the study journal, records, preset and report (re-run to resume)")
    parser.add_argument("--workers", type=int, default=1, help="parallel worker processes (or Ray tasks)")
    parser.add_argument("--threads", type=int, help="torch threads per worker (default cpu count / workers)")
    parser.add_argument("--backend", choices=("local", "ray"), default="local",
                        help="local processes (default) or Ray tasks (--address: a cluster)")
    parser.add_argument("--address", help="Ray cluster address (default: start a local Ray instance)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def tune_config(args: argparse.Namespace) -> Any:
    """A :class:`~kvsieve.tune.study.TuneConfig` from the parsed flags (every value checked)."""
    from kvsieve.tune.config import DEFAULT_BASELINES, TuneConfig

    budget = args.budget
    if args.budget_bytes is not None:
        budget = _entries_for_bytes(args.model, args.dtype, args.budget_bytes)
    choices = default_choices(args.scorers)
    for kind in ("allocator", "action", "schedule"):
        given = getattr(args, f"{kind}s")
        if given:
            choices[kind] = tuple(given)
    trials = args.trials if args.trials is not None else (None if args.time_limit else 40)
    calibration = CalibrationSet(tuple(args.tasks), tuple(args.lengths), args.samples, args.calibration_seed)
    return TuneConfig(
        budget=budget, calibration=calibration, model=args.model, dtype=args.dtype, device=args.device,
        trials=trials, time_limit=args.time_limit, batch=args.batch, prune_after=args.prune_after,
        workers=args.workers, threads=args.threads, backend=args.backend, address=args.address,
        output_dir=args.output_dir, choices=choices,
        baselines=tuple(args.baselines) if args.baselines else DEFAULT_BASELINES, seed=args.seed, name=args.name,
    )


def _entries_for_bytes(model: str, dtype: str, budget_bytes: int) -> int:
    """Entries ``budget_bytes`` per KV head hold in the model's dtype and head size (``KVCache(budget_bytes=)``'s
    conversion, so a tuned budget means what it means everywhere else)."""
    from kvsieve.engine.kv_cache import budget_from_bytes
    from kvsieve.models.loading import load_model

    loaded, _ = load_model(model, dtype, "cpu")
    return int(budget_from_bytes(loaded, {"budget_bytes": budget_bytes})["budget"])


def run_tune_command(args: argparse.Namespace) -> int:
    """Search, then print where the preset and the report are."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise MissingExtraError("kvsieve tune needs Optuna: pip install 'kvsieve[tune]'") from None
    from kvsieve.tune.study import run_tune

    outcome = run_tune(tune_config(args), progress=not args.no_progress)
    print((outcome.output_dir / "report.md").read_text(encoding="utf-8"))
    if outcome.preset_path is None:
        print("kvsieve tune: no feasible trial finished; give it more trials or time", file=sys.stderr)
        return 1
    print(f"kvsieve tune: best preset {outcome.preset_path} (use it as --policy/--policies or "
          f"KVCache(model, {str(outcome.preset_path)!r})); report in {outcome.output_dir / 'report.md'}",
          file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("tune", help="search the compositions of parts for the best cache at a memory budget "
                                         "(Optuna; resumable; writes a preset file and a Pareto report)")
    add_tune_arguments(parser)
    parser.set_defaults(func=run_tune_command)
