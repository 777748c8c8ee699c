"""``kvsieve bench``: full vs compressed caches, every configuration in a fresh subprocess.

For each repeat and context length the full cache and each policy run alternately (full, p1, p2, full,
p1, ...) so machine drift hits them alike; each run is one fresh ``python -m kvsieve.bench.worker``
(prefill once, then decoding at each batch size; with ``isolate_batches`` one process per batch size).
The summary holds, per (length, batch, cache), the median over repeats of every figure and its ratio
to the full cache's median from the same run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvsieve.bench.worker import RESULT_MARKER
from kvsieve.models.loading import DEFAULT_MODEL, parse_dtype, resolve_device
from kvsieve.models.names import validate_model_name
from kvsieve.policies.spec import PolicySpec
from kvsieve.result_files import check_output_file, cpu_info, write_json_atomic

FULL = "full"
#: Figures summarised per (length, batch, cache); each also gets a ``<name>_ratio`` to the full cache.
FIGURES = (
    "prefill_s", "decode_tokens_per_s", "latency_ms_median", "latency_ms_p90", "kv_bytes", "cache_nbytes",
    "peak_head_length", "prefill_kv_bytes", "prefill_peak_rss_bytes", "decode_peak_rss_bytes",
    "decode_extra_rss_bytes", "process_peak_rss_bytes",
)
QUICK = {"lengths": [256, 512], "batches": [1, 4], "steps": 4, "warmup": 1, "repeats": 1, "budget": 64}


@dataclass
class BenchConfig:
    """A benchmark grid. Defaults take ~8 minutes on 2 CPU cores with SmolLM2 in float32."""

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    policies: list[str] = field(default_factory=lambda: ["snapkv"])
    budget: int = 256
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    batches: list[int] = field(default_factory=lambda: [1, 4, 8])
    steps: int = 16
    warmup: int = 2
    repeats: int = 2
    isolate_batches: bool = False

    def quick(self) -> BenchConfig:
        """The smoke configuration (two short contexts, batches 1 and 4, one repeat)."""
        return replace(self, **QUICK)  # type: ignore[arg-type]


def validate(config: BenchConfig) -> list[PolicySpec]:
    """Check the grid before any process starts; returns the parsed policies."""
    from kvsieve.policies.presets import make_policy

    specs = [PolicySpec.parse(p) for p in config.policies]
    specs = [s for s in specs if s.name != FULL]
    for spec in specs:
        make_policy(spec.name, budget=config.budget, **spec.params_dict)
    parse_dtype(config.dtype)
    validate_model_name(config.model)
    resolve_device(config.device)
    for name in ("threads", "steps", "repeats"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name}: must be ≥ 1; got {getattr(config, name)}")
    if config.warmup < 0:
        raise ValueError(f"warmup: must be ≥ 0; got {config.warmup}")
    if not config.lengths or min(config.lengths) < 16:
        raise ValueError(f"lengths: give context lengths ≥ 16 tokens; got {config.lengths}")
    if not config.batches or min(config.batches) < 1:
        raise ValueError(f"batches: give batch sizes ≥ 1; got {config.batches}")
    return specs


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration in a fresh Python process; raises ``RuntimeError`` with its stderr on failure."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
    proc = subprocess.run([sys.executable, "-m", "kvsieve.bench.worker"], input=json.dumps(spec),
                          capture_output=True, text=True, env=env, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])  # type: ignore[no-any-return]
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise RuntimeError(f"benchmark worker failed (exit {proc.returncode}) for {spec}:\n{tail}")


def _runs_for(config: BenchConfig, specs: list[PolicySpec]) -> list[dict[str, Any]]:
    plan = []
    groups = [[b] for b in sorted(config.batches)] if config.isolate_batches else [sorted(config.batches)]
    for repeat in range(config.repeats):
        for length in config.lengths:
            for batches in groups:
                for spec in [PolicySpec(FULL), *specs]:
                    plan.append({
                        "repeat": repeat, "model": config.model, "dtype": config.dtype, "threads": config.threads,
                        "device": config.device,
                        "length": length, "policy": spec.name, "params": spec.params_dict, "label": spec.label,
                        "budget": None if spec.name == FULL else config.budget, "batches": batches,
                        "steps": config.steps, "warmup": config.warmup,
                    })
    return plan


def _flatten(spec: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    head = {k: spec[k] for k in ("repeat", "length", "policy", "params", "label", "budget")}
    shared = {k: v for k, v in result.items() if k != "batches"}
    for entry in result["batches"]:
        rows.append({**head, **shared, **entry})
    return rows


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats per (length, batch, cache) and ``<figure>_ratio`` to the full cache's median."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["length"], run["batch"], run["label"]), []).append(run)
    rows = []
    for (length, batch, label), group in groups.items():
        row: dict[str, Any] = {"length": length, "batch": batch, "label": label, "policy": group[0]["policy"],
                               "params": group[0]["params"], "budget": group[0]["budget"], "repeats": len(group)}
        for name in FIGURES:
            values = [g[name] for g in group if isinstance(g.get(name), int | float)]
            row[name] = statistics.median(values) if values else None
        rows.append(row)
    full = {(r["length"], r["batch"]): r for r in rows if r["label"] == FULL}
    for row in rows:
        ref = full.get((row["length"], row["batch"]), {})
        for name in FIGURES:
            value, base = row[name], ref.get(name)
            row[f"{name}_ratio"] = value / base if value is not None and base else None
    rows.sort(key=lambda r: (r["length"], r["batch"], r["label"] != FULL, r["label"]))
    return rows


def run_bench(config: BenchConfig, output: str | Path | None = None, progress: bool = True,
              plot: bool = True) -> dict[str, Any]:
    """Run the grid; write the JSON (and ``<stem>.png/.svg``) when ``output`` is given; return the result.

    The output path is checked before any run; the JSON is rewritten (atomically) after every run, so
    an interrupted benchmark keeps what it measured. A configuration that fails is recorded under
    ``failed`` (with its error) and the others go on; the result's ``complete`` says whether all ran.
    """
    specs = validate(config)
    out = None if output is None else check_output_file(output)
    plan = _runs_for(config, specs)
    runs: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    cpu = cpu_info()  # read once: the JSON is rewritten after every run

    def result(complete: bool) -> dict[str, Any]:
        return {
            "meta": {
                **asdict(config), "torch": torch.__version__, "python": platform.python_version(),
                "machine": platform.machine(), "cpu_count": os.cpu_count(), "cpu": cpu,
                "full_cache": "transformers DynamicCache",
            },
            "complete": complete,
            "summary": summarize(runs),
            "runs": runs,
            "failed": failed,
        }

    bar = tqdm(plan, desc="kvsieve bench", unit="run", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    for spec in bar:
        bar.set_postfix_str(f"{spec['length']} tok {spec['label']} batch {','.join(map(str, spec['batches']))}")
        try:
            runs.extend(_flatten(spec, run_worker({k: v for k, v in spec.items() if k not in ("repeat", "label")})))
        except RuntimeError as err:
            failed.append({**{k: spec[k] for k in ("repeat", "length", "label", "batches")}, "error": str(err)})
            tqdm.write(f"kvsieve bench: {spec['label']} at {spec['length']} tokens failed: "
                       f"{str(err).strip().splitlines()[-1]}", file=sys.stderr)
        if out is not None:
            write_json_atomic(out, result(complete=False))
    final = result(complete=not failed)
    if out is not None:
        write_json_atomic(out, final)
        if plot and runs:
            try:
                from kvsieve.bench.plot import plot_bench
            except ImportError:
                print("no figure: matplotlib is not installed (pip install 'kvsieve[plots]')", file=sys.stderr)
            else:
                plot_bench(final, out.with_suffix(""))
    return final
