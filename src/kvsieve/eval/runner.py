"""``kvsieve eval``: run a sweep of cells, append each record to ``records.jsonl``, summarise.

A cell is one task sample under one cache. The grid is every task × length × sample under the full
cache (the reference, saved in ``reference/`` for later cells) and under every policy × budget. The
cells still to run are sent to the backend grouped by task sample, so a worker builds each sample
once and fills every non-blockwise cache from one prompt forward (:mod:`kvsieve.eval.backends`).
A restarted sweep reads ``records.jsonl`` and skips the cells already there; failed cells are
logged to ``errors.jsonl`` and run again on the next start.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvsieve.eval.backends import (
    DEFAULT_CELL_FN,
    Backend,
    Cell,
    CellFn,
    Job,
    SerialBackend,
    default_threads,
    default_workers,
    make_backend,
)
from kvsieve.eval.results import ERRORS_FILE, RECORDS_FILE, CellKey, RecordWriter, done_keys, params_key, read_records
from kvsieve.eval.summary import write_summary
from kvsieve.eval.sweep_config import FULL, SweepConfig, validate_config

CONFIG_FILE = "sweep.json"
REFERENCE_DIR = "reference"


@dataclass
class SweepOutcome:
    """What a sweep did: cells run now, skipped as already done, failed; the summary rows."""

    output_dir: Path
    ran: int = 0
    skipped: int = 0
    failed: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)


def cell_key(cell: Cell) -> CellKey:
    """The same identity :func:`kvsieve.eval.results.record_key` gives the cell's record."""
    return (cell.task, cell.policy, params_key(cell.params_dict), cell.budget, cell.length, cell.sample, cell.seed)


def expand_cells(config: SweepConfig) -> list[Cell]:
    """Every cell of the sweep: per task sample, the full cache then each policy × budget.

    Sample-major (sample 0 of every length and task, then sample 1...), so a sweep stopped part-way
    has every task at fewer samples rather than some tasks at none.
    """
    cells = []
    for sample in range(config.samples):
        for length in config.lengths:
            for task in config.tasks:
                cells.append(Cell(task, FULL, (), None, length, sample, config.seed))
                for spec in config.policies:
                    for budget in config.budgets:
                        cells.append(Cell(task, spec.name, spec.params, budget, length, sample, config.seed))
    return cells


def group_cells(cells: list[Cell]) -> list[list[Cell]]:
    """The cells grouped by task sample (task, length, sample, seed), full-cache cell first in each."""
    groups: dict[tuple[str, int, int, int], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.task, cell.length, cell.sample, cell.seed), []).append(cell)
    return [sorted(group, key=lambda c: c.policy != FULL) for group in groups.values()]


def _describe(cell: Cell) -> str:
    budget = "" if cell.budget is None else f"@{cell.budget}"
    return f"{cell.task} {cell.length} #{cell.sample} {cell.policy}{budget}"


def run_sweep(
    config: SweepConfig,
    *,
    cell_fn: str | CellFn = DEFAULT_CELL_FN,
    load_model: bool = True,
    get_task: Callable[[str], Any] | None = None,
    progress: bool = True,
) -> SweepOutcome:
    """Validate, run the cells not yet in ``records.jsonl``, write the summary.

    Args:
        config: the sweep.
        cell_fn: the per-cell function (``evaluate_cell``'s signature), as a ``module:function`` path
            (any backend) or a callable (runs serially in this process; for tests and notebooks).
        load_model: False passes ``model=None, tokenizer=None`` to ``cell_fn``.
        get_task: task lookup used for validation (default :func:`kvsieve.eval.tasks.get_task`).
        progress: show a tqdm progress bar on stderr.
    """
    validate_config(config, get_task)
    _check_lengths_fit(config, load_model)
    out = Path(config.output_dir)
    identity = _model_identity(config, load_model)
    check_same_model(out, config, identity)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"output_dir: cannot create {out} ({err.strerror or err}); pass a folder path") from None
    written = {**config.to_dict(), "model_identity": identity}
    (out / CONFIG_FILE).write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
    records_path = out / RECORDS_FILE
    cells = expand_cells(config)
    done = done_keys(read_records(records_path))
    todo = [c for c in cells if cell_key(c) not in done]
    outcome = SweepOutcome(out, skipped=len(cells) - len(todo))
    if todo:
        workers = min(config.workers or default_workers(), len(todo))
        job = Job(
            model=config.model if load_model else None, dtype=config.dtype, device=config.device, cell_fn=cell_fn,
            threads=config.threads or default_threads(workers), reference_dir=str(out / REFERENCE_DIR),
        )
        if callable(cell_fn):
            backend: Backend = SerialBackend(job)
        else:
            backend = make_backend(config.backend, job, workers, config.address)
        bar = tqdm(total=len(cells), initial=outcome.skipped, desc="kvsieve eval", unit="cell", file=sys.stderr,
                   disable=not progress, dynamic_ncols=True)
        try:
            with RecordWriter(records_path) as writer:
                for cell, record, error in backend.run(group_cells(todo)):
                    if record is not None:
                        writer.write(record)
                        outcome.ran += 1
                    else:
                        outcome.failed += 1
                        _log_error(out, cell, error or "")
                    bar.set_postfix_str(_describe(cell), refresh=False)
                    bar.update()
        finally:
            bar.close()
            backend.close()
    outcome.rows = write_summary(read_records(records_path), out)
    return outcome


def _check_lengths_fit(config: SweepConfig, load_model: bool) -> None:
    """Lengths beyond the model's positions are refused before any cell runs (where the config says it)."""
    if not load_model:
        return
    from kvsieve.models.loading import max_positions

    limit = max_positions(config.model)
    too_long = [n for n in config.lengths if limit is not None and n > limit]
    if too_long:
        raise ValueError(f"lengths: {too_long} exceed the {limit} positions of {config.model!r} "
                         "(max_position_embeddings)")


def _model_identity(config: SweepConfig, load_model: bool) -> str | None:
    if not load_model:
        return None
    from kvsieve.models.loading import model_identity

    return model_identity(config.model)


def check_same_model(out: Path, config: SweepConfig, identity: str | None) -> None:
    """Refuse to add cells to a folder whose records came from another model or dtype.

    Records are keyed by task, policy, parameters, budget, length, sample and seed; a folder holds one
    model's records. Its ``sweep.json`` names the model, its fingerprint and the dtype they were made with.
    """
    previous_file = out / CONFIG_FILE
    if not previous_file.is_file() or not (out / RECORDS_FILE).is_file():
        return
    try:
        previous = json.loads(previous_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"output_dir: cannot read {previous_file} ({err}); use a new output folder") from None
    mine = {"model": config.model, "dtype": config.dtype, "model_identity": identity}
    for key, value in mine.items():
        before = previous.get(key) if isinstance(previous, dict) else None
        if value is not None and before is not None and before != value:
            raise ValueError(
                f"output_dir: {out} holds records of {key} {before!r}, not {value!r} (model "
                f"{previous.get('model')!r}, dtype {previous.get('dtype')!r}); its records would be reported as "
                "this run's. Use another --output-dir for this model/dtype"
            )


def _log_error(out: Path, cell: Cell, error: str) -> None:
    entry = {"task": cell.task, "policy": cell.policy, "params": cell.params_dict, "budget": cell.budget,
             "length": cell.length, "sample": cell.sample, "seed": cell.seed, "error": error}
    with (out / ERRORS_FILE).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")
    last = error.strip().splitlines()[-1] if error.strip() else "unknown error"
    tqdm.write(f"kvsieve eval: {_describe(cell)} failed: {last} (see {out / ERRORS_FILE})", file=sys.stderr)
