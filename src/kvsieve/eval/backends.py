"""Where sweep cells run: in this process, in local worker processes, or as Ray tasks.

The unit of work is a *group*: the cells of one task sample (same task, length, sample and seed),
which :func:`execute_group` evaluates together so they share the sample, the full-cache reference and
one prompt forward (:func:`kvsieve.eval.evaluate.evaluate_cells`); a custom ``cell_fn`` runs cell by
cell. Every backend calls the same :func:`execute_group` on the same :class:`Job`, so a cell gives the
same record wherever it runs. Each worker process loads the model once (a process-wide cache keyed by model
name and dtype) and sets its torch threads to the job's ``threads``. Results stream back in completion
order; the runner alone writes them to disk.
"""

from __future__ import annotations

import importlib
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import torch

DEFAULT_CELL_FN = "kvsieve.eval.evaluate:evaluate_cell"
CellFn = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Cell:
    """One evaluation: a task sample under one cache (``policy="full"``, ``budget=None`` for the reference)."""

    task: str
    policy: str
    params: tuple[tuple[str, Any], ...]
    budget: int | None
    length: int
    sample: int
    seed: int

    @property
    def params_dict(self) -> dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class Job:
    """What every worker needs besides the cell (picklable when ``cell_fn`` is a ``module:function`` path).

    ``model`` None skips loading a model (the cell function then gets ``model=None, tokenizer=None``).
    """

    model: str | None
    dtype: str = "float32"
    device: str = "cpu"
    cell_fn: str | CellFn = DEFAULT_CELL_FN
    threads: int = 1
    reference_dir: str | None = None


Outcome = tuple[Cell, dict[str, Any] | None, str | None]  # (cell, record, error traceback)
_LOADED: dict[tuple[str, str, str], tuple[Any, Any]] = {}


def resolve_cell_fn(ref: str | CellFn) -> CellFn:
    """The cell function itself from a callable or a ``module:function`` path."""
    if callable(ref):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _model_for(job: Job) -> tuple[Any, Any]:
    if job.model is None:
        return None, None
    key = (job.model, job.dtype, job.device)
    if key not in _LOADED:
        from kvsieve.models.loading import load_model

        _LOADED.clear()  # one model per worker process
        _LOADED[key] = load_model(job.model, job.dtype, job.device)
    return _LOADED[key]


def execute_cell(job: Job, cell: Cell) -> Outcome:
    """Run one cell in this process; never raises (errors come back as a traceback string)."""
    try:
        if torch.get_num_threads() != job.threads:
            torch.set_num_threads(job.threads)
        model, tokenizer = _model_for(job)
        fn = resolve_cell_fn(job.cell_fn)
        started = time.perf_counter()
        with torch.no_grad():
            record = fn(
                model, tokenizer, task=cell.task, policy=cell.policy, budget=cell.budget, length=cell.length,
                sample_index=cell.sample, seed=cell.seed, policy_params=cell.params_dict or None,
                reference_dir=job.reference_dir,
            )
        return cell, _record(cell, record, time.perf_counter() - started), None
    except Exception:  # one bad cell must not end the sweep
        return cell, None, traceback.format_exc()


def _record(cell: Cell, record: dict[str, Any], elapsed: float) -> dict[str, Any]:
    record = dict(record)
    record.setdefault("elapsed_s", elapsed)
    # The runner's identity fields win, so resuming always finds the cell again.
    record.update(task=cell.task, policy=cell.policy, params=cell.params_dict, budget=cell.budget,
                  length=cell.length, sample=cell.sample, seed=cell.seed)
    return record


def execute_group(job: Job, cells: Sequence[Cell]) -> list[Outcome]:
    """Run the cells of one task sample in this process; cell failures come back as outcomes.

    With the default cell function they are evaluated together (one sample, one shared prompt
    forward); if that fails, each cell is run on its own so a bad cell only fails itself. Cells of
    different task samples are a caller error (``ValueError``).
    """
    if job.cell_fn != DEFAULT_CELL_FN or len(cells) < 2:
        return [execute_cell(job, cell) for cell in cells]
    first = cells[0]
    if any((c.task, c.length, c.sample, c.seed) != (first.task, first.length, first.sample, first.seed) for c in cells):
        raise ValueError("execute_group: every cell of a group must be the same task sample")
    try:
        from kvsieve.eval.evaluate import evaluate_cells

        if torch.get_num_threads() != job.threads:
            torch.set_num_threads(job.threads)
        model, tokenizer = _model_for(job)
        started = time.perf_counter()
        specs = [(c.policy, c.budget, c.params_dict or None) for c in cells]
        with torch.no_grad():
            records = evaluate_cells(model, tokenizer, first.task, specs, first.length, first.sample, first.seed,
                                     job.reference_dir)
        elapsed = (time.perf_counter() - started) / len(cells)
        return [(cell, _record(cell, rec, elapsed), None) for cell, rec in zip(cells, records, strict=True)]
    except Exception:
        return [execute_cell(job, cell) for cell in cells]


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


class SerialBackend:
    """Runs the cells one by one in this process (``--workers 1``; also what tests inject functions into)."""

    name = "serial"

    def __init__(self, job: Job):
        self.job = job

    def run(self, groups: Sequence[Sequence[Cell]]) -> Iterator[Outcome]:
        for group in groups:
            yield from execute_group(self.job, group)

    def close(self) -> None:
        return None


class ProcessBackend:
    """``workers`` spawned processes on this machine (``concurrent.futures`` with the spawn context)."""

    name = "local"

    def __init__(self, job: Job, workers: int):
        if callable(job.cell_fn):
            raise ValueError("worker processes need the cell function as a 'module:function' path")
        self.job = job
        self.pool = ProcessPoolExecutor(
            max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker, initargs=(job.threads,)
        )

    def run(self, groups: Sequence[Sequence[Cell]]) -> Iterator[Outcome]:
        pending: set[Future[list[Outcome]]] = {
            self.pool.submit(execute_group, self.job, list(group)) for group in groups
        }
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield from future.result()
        finally:
            for future in pending:
                future.cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class RayBackend:
    """The same cells as Ray tasks: a local Ray instance by default, or the cluster at ``address``.

    Each task asks for ``job.threads`` CPUs; a local instance gets ``workers × threads`` CPUs, so at most
    ``workers`` cells run at once. Ray reuses its worker processes, so each loads the model once.
    """

    name = "ray"

    def __init__(self, job: Job, workers: int, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise RuntimeError("the ray backend needs Ray: pip install 'kvsieve[ray]'") from None
        if callable(job.cell_fn):
            raise ValueError("Ray tasks need the cell function as a 'module:function' path")
        self.ray = ray
        self.job = job
        self.started = not ray.is_initialized()
        if self.started:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=workers * job.threads, include_dashboard=False, log_to_driver=False)
        self.remote = ray.remote(num_cpus=job.threads, max_retries=0)(execute_group)

    def run(self, groups: Sequence[Sequence[Cell]]) -> Iterator[Outcome]:
        pending = [self.remote.remote(self.job, list(group)) for group in groups]
        try:
            while pending:
                done, pending = self.ray.wait(pending, num_returns=1)
                for ref in done:
                    yield from self.ray.get(ref)
        finally:
            for ref in pending:
                self.ray.cancel(ref)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


Backend = SerialBackend | ProcessBackend | RayBackend


def default_workers() -> int:
    """``min(2, cpu count)``."""
    return max(1, min(2, os.cpu_count() or 1))


def default_threads(workers: int) -> int:
    """Cores per worker: ``cpu count // workers`` (at least 1)."""
    return max(1, (os.cpu_count() or 1) // workers)


def make_backend(kind: str, job: Job, workers: int, address: str | None = None) -> Backend:
    """``local`` (serial for one worker, processes otherwise) or ``ray``."""
    if kind == "ray":
        return RayBackend(job, workers, address)
    if kind != "local":
        raise ValueError(f"unknown backend {kind!r}; choose 'local' or 'ray'")
    return SerialBackend(job) if workers == 1 else ProcessBackend(job, workers)
