"""``kvsieve tune``'s search: Optuna trials over compositions, scored on a calibration set at a memory budget.

Why Optuna (and not Ray Tune): the search is sequential model-based optimisation over a *conditional* space
(each part brings its own fields), which Optuna's define-by-run TPE handles natively, with pruning and a
resumable on-disk journal and no server; the expensive part is evaluating a trial, and kvsieve already spreads
evaluation cells over local processes or a Ray cluster (:mod:`kvsieve.eval.backends`), so Ray Tune would only
add a second scheduler. ``--backend ray`` sends the cells of every trial to Ray like ``kvsieve eval``.

One round (deterministic given the seed, the settings and where a stopped search was resumed):

1. ``batch`` trials are asked together (TPE with the constant liar, so they differ) and each becomes a
   composition; a composition the policy refuses fails at once, before any model work;
2. the surviving trials are evaluated together on the first ``prune_after`` calibration samples — one cell
   group per sample, so a worker builds the sample and one shared prompt forward for every trial — and each
   reports its mean KL there; the median pruner stops the ones worse than the median of earlier trials;
3. the rest run on the remaining samples, and each trial is told, in trial order, its objective: the mean
   KL(full ‖ policy) per answer token over the calibration set (lower is better). The answer's log-likelihood
   gap, exact match and bytes held are kept as the trial's attributes.

The budget is a memory budget: a trial is feasible only if the KV bytes it really holds (keys, values, scales,
side data: the records' ``kv_bytes_held``) over the calibration cells are at most ``1 + byte_tolerance`` times
what ``snapkv`` at the same budget holds on the same cells (the equal-memory anchor, always evaluated with the
baselines). TPE's constraint handling steers away from infeasible trials, and the best preset is the best
*feasible* trial. Every cell is appended to ``records.jsonl`` and reused on a restart (and by a repeated
composition), the study lives in ``study.journal``: stopping and re-running the command resumes it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvsieve.eval.backends import DEFAULT_CELL_FN, Backend, Cell, Job, default_threads, make_backend
from kvsieve.eval.results import RECORDS_FILE, RecordWriter, read_records, record_key
from kvsieve.eval.runner import cell_key
from kvsieve.tune.calibration import groups_for
from kvsieve.tune.config import ANCHOR, TrialResult, TuneConfig, summarise
from kvsieve.tune.report import write_report
from kvsieve.tune.space import Composition, Space

STUDY_NAME = "kvsieve-tune"
JOURNAL_FILE = "study.journal"
CONFIG_FILE = "tune.json"


class CellCache:
    """Every calibration cell's record, on disk (``records.jsonl``) and in memory; runs only what is missing."""

    def __init__(self, out: Path, backend: Backend):
        self.path = out / RECORDS_FILE
        self.backend = backend
        self.records = {record_key(r): r for r in read_records(self.path)}

    def run(self, groups: list[list[Cell]]) -> dict[Cell, str]:
        """Evaluate the cells not yet recorded; returns the failed ones with their tracebacks."""
        todo = [[c for c in group if cell_key(c) not in self.records] for group in groups]
        todo = [group for group in todo if group]
        failed: dict[Cell, str] = {}
        if not todo:
            return failed
        with RecordWriter(self.path) as writer:
            for cell, record, error in self.backend.run(todo):
                if record is None:
                    failed[cell] = error or "unknown error"
                    continue
                writer.write(record)
                self.records[record_key(record)] = record
        return failed

    def of(self, cells: Sequence[Cell]) -> list[dict[str, Any]]:
        return [self.records[cell_key(c)] for c in cells]


@dataclass
class TuneOutcome:
    """What the search found: the study, the best feasible trial's composition and its preset file."""

    output_dir: Path
    study: Any
    best: Composition | None
    best_result: TrialResult | None
    preset_path: Path | None
    baselines: dict[str, TrialResult]
    anchor_bytes: float


def _has_set_constraint(optuna: Any) -> bool:
    return hasattr(optuna.trial.Trial, "set_constraint")


def _set_bytes_constraint(optuna: Any, trial: Any, over: float) -> None:
    """Record how far over the byte budget a trial is (≤ 0: feasible) where the sampler will read it."""
    trial.set_user_attr("bytes_over", over)
    if _has_set_constraint(optuna):
        trial.set_constraint("kv_bytes_over_budget", over)


def _constraint(trial: Any) -> Sequence[float]:
    """TPE's constraint: ≤ 0 when the trial holds no more bytes than allowed (pruned/failed trials: feasible)."""
    return [float(trial.user_attrs.get("bytes_over", 0.0))]


def _policy_error(composition: Composition, budget: int) -> str | None:
    from kvsieve.policies.presets import make_policy

    try:
        make_policy(composition.base, budget=budget, **composition.params_dict)
    except ValueError as err:
        return str(err)
    return None


def open_study(out: Path, seed: int, startup: int) -> Any:
    """The study in ``out/study.journal`` (created or resumed; trials a stopped run left running are failed)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(str(out / JOURNAL_FILE)))
    # Optuna ≥ 5 reads constraints a trial sets (``Trial.set_constraint``, see :func:`_set_bytes_constraint`);
    # before 5 the sampler asks a ``constraints_func`` (deprecated in 5)
    legacy = {} if _has_set_constraint(optuna) else {"constraints_func": _constraint}
    pruner = optuna.pruners.MedianPruner(n_startup_trials=max(2, startup // 2), n_warmup_steps=0)
    study = optuna.create_study(storage=storage, pruner=pruner, study_name=STUDY_NAME, direction="minimize",
                                load_if_exists=True)
    for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(stale.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    # a resumed search continues from the trials it has: re-seeding with the seed alone would draw the first
    # trials' parts again; seeding with (seed, trials so far) keeps it deterministic given where it stopped
    resumed_at = len(study.get_trials(deepcopy=False))
    study.sampler = optuna.samplers.TPESampler(seed=seed + 1_000_003 * resumed_at, constant_liar=True,
                                               n_startup_trials=startup, **legacy)
    return study


def run_tune(config: TuneConfig, *, progress: bool = True) -> TuneOutcome:
    """Validate, evaluate the baselines, search, write the best preset and the report (see the module docstring)."""
    config.validate()
    out = Path(config.output_dir)
    _check_same_setup(out, config)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
    threads = config.threads or default_threads(config.workers)
    job = Job(model=config.model, dtype=config.dtype, device=config.device, cell_fn=DEFAULT_CELL_FN,
              threads=threads, reference_dir=str(out / "reference"))
    backend = make_backend(config.backend, job, config.workers, config.address)  # serial for one local worker
    calibration, budget = config.calibration, config.budget
    size = calibration.size()
    try:
        cache = CellCache(out, backend)
        references = [(name, ()) for name in dict.fromkeys((ANCHOR, *config.baselines))]
        failed = cache.run(groups_for(calibration, references, budget, 0, size, with_full=True))
        if failed:
            cell, error = next(iter(failed.items()))
            raise RuntimeError(f"{len(failed)} baseline cells failed; the first, {cell}:\n{error}")
        baselines = {name: summarise(cache.of(_cells(groups_for(calibration, [(name, ())], budget, 0, size))))
                     for name, _ in references}
        anchor_bytes = baselines[ANCHOR].kv_bytes
        study = open_study(out, config.seed, startup=max(4, 2 * config.batch))
        _search(study, config, cache, anchor_bytes, progress)
    finally:
        backend.close()
    best_trial = _best_feasible(study)
    best = composition_of(best_trial) if best_trial is not None else None
    best_result = TrialResult(**best_trial.user_attrs["result"]) if best_trial is not None else None
    preset_path = None
    if best is not None and best_result is not None:
        preset_path = write_best_preset(out, config, best, best_result, baselines, anchor_bytes)
    write_report(out, study, baselines, anchor_bytes, config)
    return TuneOutcome(out, study, best, best_result, preset_path, baselines, anchor_bytes)


def _cells(groups: list[list[Cell]]) -> list[Cell]:
    return [cell for group in groups for cell in group]


def _search(study: Any, config: TuneConfig, cache: CellCache, anchor_bytes: float, progress: bool) -> None:
    import optuna

    states = optuna.trial.TrialState
    finished = len(study.get_trials(deepcopy=False, states=(states.COMPLETE, states.PRUNED)))
    refused = 0
    space = Space.build(config.choices, config.budget)
    started, ran = time.monotonic(), False
    bar = tqdm(total=config.trials, initial=min(finished, config.trials or finished), desc="kvsieve tune",
               unit="trial", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    size, budget, calibration = config.calibration.size(), config.budget, config.calibration
    split = min(config.prune_after, size)
    try:
        while config.trials is None or finished < config.trials:
            if config.time_limit is not None and ran and time.monotonic() - started >= config.time_limit:
                break  # the limit ends the search after the batch running when it expires (at least one runs)
            ran = True
            count = config.batch if config.trials is None else min(config.batch, config.trials - finished)
            asked = [study.ask() for _ in range(count)]
            refused_now = 0
            live: list[tuple[Any, Composition]] = []
            for trial in asked:
                composition = space.suggest(trial)
                trial.set_user_attr("composition", {"base": composition.base, "params": composition.params_dict})
                trial.set_user_attr("label", composition.label())
                error = _policy_error(composition, budget)
                if error is not None:
                    trial.set_user_attr("refused", error)
                    study.tell(trial, state=states.FAIL)
                    refused_now += 1
                else:
                    live.append((trial, composition))
            failed = cache.run(groups_for(calibration, [c for _, c in live], budget, 0, split))
            live = _drop_failed(study, live, failed)
            survivors = []
            for trial, composition in live:
                early = summarise(cache.of(_cells(groups_for(calibration, [composition], budget, 0, split))))
                trial.report(early.kl, step=split)
                if split < size and trial.should_prune():
                    trial.set_user_attr("result", asdict(early))
                    study.tell(trial, state=states.PRUNED)
                else:
                    survivors.append((trial, composition))
            failed = cache.run(groups_for(calibration, [c for _, c in survivors], budget, split, size))
            for trial, composition in _drop_failed(study, survivors, failed):
                result = summarise(cache.of(_cells(groups_for(calibration, [composition], budget, 0, size))))
                over = result.kv_bytes / anchor_bytes - (1.0 + config.byte_tolerance)
                trial.set_user_attr("result", asdict(result))
                _set_bytes_constraint(optuna, trial, over)
                study.tell(trial, result.kl)
            finished += count - refused_now  # a refused composition costs no model work and counts for nothing
            refused += refused_now
            bar.update(count - refused_now)
            if refused > 10 * max(config.trials or 0, 10):
                raise RuntimeError(f"{refused} compositions were refused by the policy; narrow --scorers/--allocators/"
                                   "--actions/--schedules (see the study's refused trials)")
            best = _best_feasible(study)
            if best is not None:
                bar.set_postfix_str(f"best KL {best.value:.3f}: {best.user_attrs['label']}", refresh=False)
    finally:
        bar.close()


def _drop_failed(study: Any, trials: list[tuple[Any, Composition]], failed: dict[Cell, str]
                 ) -> list[tuple[Any, Composition]]:
    """Fail (and drop) the trials one of whose cells failed: one bad composition must not end the search."""
    import optuna

    if not failed:
        return trials
    kept = []
    for trial, composition in trials:
        errors = [error for cell, error in failed.items() if (cell.policy, cell.params) == (composition.base,
                                                                                            composition.params)]
        if errors:
            trial.set_user_attr("error", errors[0].strip().splitlines()[-1][:500])
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            kept.append((trial, composition))
    return kept


def _best_feasible(study: Any) -> Any:
    import optuna

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    feasible = [t for t in complete if t.user_attrs.get("bytes_over", 0.0) <= 0.0 and t.value is not None]
    return min(feasible, key=lambda t: (t.value, t.number)) if feasible else None


def composition_of(trial: Any) -> Composition:
    stored = trial.user_attrs["composition"]
    return Composition(stored["base"], tuple(sorted(stored["params"].items())))


def write_best_preset(out: Path, config: TuneConfig, best: Composition, result: TrialResult,
                      baselines: dict[str, TrialResult], anchor_bytes: float) -> Path:
    """``out/<name>.json``: the best feasible composition as a preset file, with where it came from."""
    from importlib import metadata

    from kvsieve.models.loading import model_identity
    from kvsieve.policies.preset_file import write_preset_file

    name = config.name or f"tuned_b{config.budget}"
    provenance = {
        "model": config.model, "model_identity": model_identity(config.model), "dtype": config.dtype,
        "kvsieve_version": metadata.version("kvsieve"), "calibration": config.calibration.to_dict(),
        "score": {"kl_per_answer_token": result.kl, "logprob_gap": result.logprob_gap, "exact_match": result.score,
                  "kv_bytes_held_over_anchor": result.kv_bytes / anchor_bytes, "anchor": ANCHOR},
        "baselines_on_calibration": {name: b.kl for name, b in baselines.items()},
        "search": {"seed": config.seed, "output_dir": str(out)},
    }
    return write_preset_file(out / f"{name}.json", name, best.base, best.params_dict, config.budget,
                             summary=best.label(), provenance=provenance)


def _check_same_setup(out: Path, config: TuneConfig) -> None:
    """A folder holds one search: refuse to resume it with another model, budget or calibration set."""
    previous_file = out / CONFIG_FILE
    if not previous_file.is_file():
        return
    try:
        previous = json.loads(previous_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"--output-dir: cannot read {previous_file} ({err}); use a new folder") from None
    mine = config.to_dict()
    for key in ("model", "dtype", "budget", "calibration", "choices", "seed", "prune_after", "batch"):
        if previous.get(key) != mine[key]:
            raise ValueError(f"--output-dir: {out} holds a search with {key} {previous.get(key)!r}, not "
                             f"{mine[key]!r}; resume it with the same settings or use another folder")
