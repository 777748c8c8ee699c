"""``kvsieve bench`` on a tiny random Llama: well-formed JSON, ratios to the full cache, the figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvsieve.bench import runner, worker
from kvsieve.bench.runner import FIGURES, BenchConfig, run_bench
from kvsieve.bench.worker import run_configuration
from kvsieve.cli import build_parser
from kvsieve.models.loading import load_model
from kvsieve.result_files import cpu_info

TINY = BenchConfig(model="tiny-llama", policies=["snapkv"], budget=32, lengths=[64, 96],
                   batches=[1, 2], steps=2, warmup=1, repeats=2)


def test_quick_mode_writes_well_formed_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every configuration in this process, the tiny model built once (the subprocess is tested below).
    model = load_model("tiny-llama")
    monkeypatch.setattr(worker, "load_model", lambda name, dtype, device="cpu": model)
    monkeypatch.setattr(runner, "run_worker", run_configuration)
    out = tmp_path / "bench.json"
    run_bench(TINY, output=out, progress=False)
    result = json.loads(out.read_text())
    assert result["meta"]["model"] == "tiny-llama" and result["meta"]["lengths"] == [64, 96]
    assert result["meta"]["cpu"] == cpu_info()  # the CPU model, its bf16 support and vector paths
    assert len(result["runs"]) == 2 * 2 * 2 * 2  # repeats × lengths × caches × batches
    assert [(r["repeat"], r["label"]) for r in result["runs"][:8:2]] == [(0, "full"), (0, "snapkv")] * 2
    summary = result["summary"]
    assert len(summary) == 2 * 2 * 2
    for row in summary:
        assert row["repeats"] == 2
        assert row["decode_tokens_per_s"] > 0 and row["prefill_s"] > 0 and row["latency_ms_median"] > 0
        assert row["decode_peak_rss_bytes"] > 0 and row["process_peak_rss_bytes"] >= row["decode_peak_rss_bytes"]
        if row["label"] == "full":
            assert all(row[f"{name}_ratio"] in (1.0, None) for name in FIGURES)
            assert row["peak_head_length"] == row["length"] + 3  # prompt + warm-up + timed steps
        else:
            assert row["kv_bytes_ratio"] < 0.6 and row["prefill_kv_bytes_ratio"] <= 0.5
    full = next(r for r in summary if r["label"] == "full" and r["batch"] == 2 and r["length"] == 64)
    full1 = next(r for r in summary if r["label"] == "full" and r["batch"] == 1 and r["length"] == 64)
    assert full["kv_bytes"] == 2 * full1["kv_bytes"]
    assert (tmp_path / "bench.png").stat().st_size > 5000 and (tmp_path / "bench.svg").exists()


def test_worker_runs_in_a_fresh_process() -> None:
    spec: dict[str, Any] = {"model": "tiny-llama", "dtype": "float32", "threads": 1, "length": 64,
                            "policy": "snapkv", "params": {}, "budget": 32, "batches": [1], "steps": 2, "warmup": 0}
    result = runner.run_worker(spec)
    assert result["prefill_kv_bytes"] > 0 and result["batches"][0]["batch"] == 1
    assert result["process_peak_rss_bytes"] >= result["rss_model_bytes"] > 0
    with pytest.raises(ValueError, match="positions"):
        run_configuration({**spec, "length": 40000})


def test_cli_flags_and_validation() -> None:
    from kvsieve.bench.commands import config_from_args

    args = build_parser().parse_args(["bench", "--quick", "--policies", "snapkv,h2o:schedule=decode", "--steps", "3"])
    config = config_from_args(args)
    assert config.lengths == [256, 512] and config.steps == 3 and config.budget == 64
    assert runner.validate(config)[1].params_dict == {"schedule": "decode"}
    with pytest.raises(ValueError, match="unknown policy"):
        runner.validate(BenchConfig(policies=["nope"]))
    with pytest.raises(ValueError, match="batches"):
        runner.validate(BenchConfig(batches=[0]))


def test_unwritable_output_is_refused_before_any_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(runner, "run_worker", lambda spec: calls.append(spec) or {})
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (blocker / "bench.json", tmp_path):  # below a file; a folder
        with pytest.raises(ValueError, match="--output"):
            run_bench(TINY, output=bad, progress=False)
    assert calls == []


def test_a_failing_configuration_keeps_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One failing policy used to discard every completed run; now it is recorded as failed."""
    model = load_model("tiny-llama")
    monkeypatch.setattr(worker, "load_model", lambda name, dtype, device="cpu": model)
    written: list[dict[str, Any]] = []

    def flaky(spec: dict[str, Any]) -> dict[str, Any]:
        if spec["policy"] == "snapkv" and spec["length"] == 96:
            raise RuntimeError("benchmark worker failed (exit 1):\nboom")
        written.append(json.loads(out.read_text())) if out.exists() else None
        return run_configuration(spec)

    monkeypatch.setattr(runner, "run_worker", flaky)
    out = tmp_path / "bench.json"
    config = BenchConfig(model="tiny-llama", policies=["snapkv"], budget=32, lengths=[64, 96], batches=[1],
                         steps=1, warmup=0, repeats=1)
    result = run_bench(config, output=out, progress=False, plot=False)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result)) and saved["complete"] is False
    assert [f["label"] for f in saved["failed"]] == ["snapkv"] and "boom" in saved["failed"][0]["error"]
    assert len(saved["runs"]) == 3  # full@64, snapkv@64, full@96
    assert written and written[-1]["complete"] is False and len(written[-1]["runs"]) >= 1  # written as it went
