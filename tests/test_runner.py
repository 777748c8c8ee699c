"""The sweep runner: validation, resuming without redoing work, well-formed outputs, backends agree."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from kvsieve.cli import main
from kvsieve.eval.commands import config_values
from kvsieve.eval.results import read_records, record_key
from kvsieve.eval.runner import expand_cells, run_sweep
from kvsieve.eval.sweep_config import SweepConfig, SweepConfigError, build_config, validate_config
from kvsieve.policies.spec import PolicySpec, PolicySpecError

TIMING = ("elapsed_s", "prefill_s", "decode_s")


class FakeCell:
    """Stands in for ``evaluate_cell``: a deterministic record per cell, counting its calls."""

    def __init__(self, fail: set[tuple[str, int | None, int]] | None = None):
        self.calls: list[tuple[str, str, int | None, int]] = []
        self.fail = fail or set()

    def __call__(self, model: Any, tokenizer: Any, *, task: str, policy: str, budget: int | None, length: int,
                 sample_index: int, seed: int, policy_params: dict | None = None,
                 reference_dir: str | None = None) -> dict[str, Any]:
        assert model is None and tokenizer is None
        self.calls.append((task, policy, budget, sample_index))
        if (policy, budget, sample_index) in self.fail:
            raise RuntimeError("boom")
        strength = 1.0 if budget is None else budget / 64
        return {
            "task": task, "policy": policy, "budget": budget, "length": length, "sample": sample_index,
            "seed": seed, "prompt_tokens": length, "score": float(sample_index % 2 == 0 or strength >= 1),
            "generated": "42", "answer_logprob": -1.0 - 4 * (1 - strength) - 0.1 * sample_index,
            "answer_logprob_full": -1.0 - 0.1 * sample_index, "logprob_gap": 4 * (1 - strength),
            "kl_full_compressed": 0.0 if budget is None else 0.1, "kv_bytes_held": min(budget or length, length),
            "kv_bytes_full": length, "elapsed_s": 0.01,
        }


def _config(tmp_path: Path, **overrides: Any) -> SweepConfig:
    values = {"policies": ["snapkv", "h2o:schedule=decode"], "budgets": [32, 64], "tasks": ["niah_single_1", "vt"],
              "lengths": [512], "samples": 2, "seed": 3, "output_dir": str(tmp_path / "sweep"), "workers": 1,
              "threads": 1}
    values.update(overrides)
    return build_config(values)


def test_resume_skips_done_cells(tmp_path: Path) -> None:
    config = _config(tmp_path)
    fake = FakeCell()
    outcome = run_sweep(config, cell_fn=fake, load_model=False, progress=False)
    total = 2 * 2 * (1 + 2 * 2)  # tasks × samples × (full + policies × budgets)
    assert (outcome.ran, outcome.skipped, outcome.failed) == (total, 0, 0)
    assert len(fake.calls) == total
    # Cells run grouped by task sample, the full-cache reference first in each group.
    group = 1 + 2 * 2
    for start in range(0, total, group):
        calls = fake.calls[start : start + group]
        assert calls[0][1] == "full" and all(c[1] != "full" for c in calls[1:])
        assert len({(c[0], c[3]) for c in calls}) == 1

    again = FakeCell()
    outcome = run_sweep(config, cell_fn=again, load_model=False, progress=False)
    assert again.calls == [] and (outcome.ran, outcome.skipped) == (0, total)

    # An interrupted write: drop three records and truncate the last kept line mid-way.
    path = tmp_path / "sweep" / "records.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-4]) + "\n" + lines[-4][:25])
    third = FakeCell()
    outcome = run_sweep(config, cell_fn=third, load_model=False, progress=False)
    assert len(third.calls) == 4 and outcome.ran == 4
    records = read_records(path)
    assert len(records) == total
    assert len({record_key(r) for r in records}) == total


def test_outputs_are_well_formed(tmp_path: Path) -> None:
    config = _config(tmp_path)
    run_sweep(config, cell_fn=FakeCell(), load_model=False, progress=False)
    out = tmp_path / "sweep"
    for line in (out / "records.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert {"task", "policy", "params", "budget", "length", "sample", "seed", "score"} <= record.keys()
        assert record["params"] == ({"schedule": "decode"} if record["policy"] == "h2o" else {})
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert len(rows) == 2 * (1 + 2 * 2)  # tasks × caches
    snap = next(r for r in rows if r["task"] == "vt" and r["policy"] == "snapkv" and r["budget"] == "32")
    assert snap["samples"] == "2" and float(snap["score"]) == 0.5 and float(snap["score_se"]) == 0.5
    assert float(snap["score_full"]) == 1.0 and float(snap["answer_logprob_full"]) == pytest.approx(-1.05)
    assert float(snap["kv_ratio"]) == pytest.approx(32 / 512)
    full = next(r for r in rows if r["task"] == "vt" and r["policy"] == "full")
    assert full["budget"] == "" and float(full["logprob_gap"]) == 0.0
    markdown = (out / "summary.md").read_text()
    assert "## niah_single_1" in markdown and "## vt" in markdown
    lines = markdown.splitlines()
    header = lines[lines.index("## niah_single_1") + 2]
    table = [line for line in lines if line.startswith("| 512 | h2o(schedule=decode) | 64 |")]
    assert len(table) == 3 and table[-1].count("|") == header.count("|")  # suite row + one per task
    # Suite average: both tasks' samples pooled (scores 1, 0, 1, 0 → 0.5, SE √(1/3)/2).
    assert "## Suite average (all tasks but perplexity)" in markdown
    assert "| 512 | snapkv | 32 | 2 | 4 | 0.500 ± 0.289 | 2.00 ± 0.00 | 0.100 ± 0.000 | 6.2% |" in markdown
    assert json.loads((out / "sweep.json").read_text())["policies"][1] == {"name": "h2o", "schedule": "decode"}


def test_failed_cells_are_logged_and_retried(tmp_path: Path) -> None:
    config = _config(tmp_path, tasks=["vt"], samples=1)
    outcome = run_sweep(config, cell_fn=FakeCell(fail={("snapkv", 64, 0)}), load_model=False, progress=False)
    assert outcome.failed == 1 and outcome.ran == 4
    error = json.loads((tmp_path / "sweep" / "errors.jsonl").read_text().splitlines()[0])
    assert error["policy"] == "snapkv" and error["budget"] == 64 and "boom" in error["error"]
    retry = FakeCell()
    assert run_sweep(config, cell_fn=retry, load_model=False, progress=False).ran == 1
    assert retry.calls == [("vt", "snapkv", 64, 0)]


def test_validation_happens_before_any_work(tmp_path: Path) -> None:
    fake = FakeCell()
    cases = [
        ({"policies": ["snapkv", "nope"]}, "unknown policy 'nope'"),
        ({"tasks": ["niah_single_1", "qa_9"]}, "unknown task 'qa_9'; known tasks:"),
        ({"budgets": [0]}, "budget must be an int"),
        ({"policies": ["snapkv:window=-3"]}, "snapkv"),
        ({"lengths": [100]}, "length must be"),
        ({"samples": 0}, "samples"),
        ({"backend": "slurm"}, "backend"),
        ({"model": "no-such-model"}, "unknown model"),
    ]
    for overrides, message in cases:
        with pytest.raises(SweepConfigError, match=message):
            run_sweep(_config(tmp_path, **overrides), cell_fn=fake, load_model=False, progress=False)
    assert fake.calls == []
    assert not (tmp_path / "sweep").exists()
    with pytest.raises(SweepConfigError, match="unknown sweep setting 'budget'"):
        build_config({"budget": 3})
    with pytest.raises(PolicySpecError, match="give budgets with 'budgets'"):
        PolicySpec.parse({"name": "snapkv", "budget": 3})
    with pytest.raises(SweepConfigError, match="give budgets with 'budgets'"):
        build_config({"policies": ["snapkv:budget=3"]})


def test_yaml_config_and_flag_overrides(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(
        "policies:\n  - snapkv\n  - {name: h2o, schedule: blockwise, block_size: 64}\n"
        "budgets: [64, 128]\ntasks: niah_single_1,vt\nlengths: [1024]\nsamples: 3\noutput-dir: out\n"
    )
    from kvsieve.cli import build_parser

    args = build_parser().parse_args(["eval", "--config", str(path), "--budgets", "32", "--seed", "7"])
    config = build_config(config_values(args))
    assert config.policies == [PolicySpec("snapkv"), PolicySpec("h2o", (("block_size", 64), ("schedule", "blockwise")))]
    assert config.policies[1].label == "h2o(block_size=64,schedule=blockwise)"
    assert (config.budgets, config.tasks, config.lengths, config.samples, config.seed, config.output_dir) == (
        [32], ["niah_single_1", "vt"], [1024], 3, 7, "out")
    validate_config(config)
    cells = expand_cells(config)
    assert len(cells) == 2 * 3 * (1 + 2) and cells[0].policy == "full" and cells[0].budget is None


# ---------------------------------------------------------------------------------------------- end to end
def _tiny_config(tmp_path: Path, name: str, **overrides: Any) -> SweepConfig:
    values = {"policies": ["snapkv"], "budgets": [32], "tasks": ["passkey"], "lengths": [256], "samples": 1,
              "output_dir": str(tmp_path / name), "workers": 1, "threads": 1, "model": "tiny-llama"}
    values.update(overrides)
    return build_config(values)


def _comparable(path: Path) -> dict[tuple, dict[str, Any]]:
    return {record_key(r): {k: v for k, v in r.items() if k not in TIMING} for r in read_records(path)}


def test_cli_end_to_end_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    code = main(["eval", "--model", "tiny-llama", "--policies", "snapkv,streaming_llm", "--budgets", "32",
                 "--tasks", "passkey,niah_single_1", "--lengths", "256", "--workers", "1", "--threads", "1",
                 "--output-dir", str(out), "--no-progress"])
    assert code == 0
    records = read_records(out / "records.jsonl")
    assert len(records) == 2 * 3
    for record in records:
        assert 0.0 <= record["score"] <= 1.0 and record["kv_bytes_held"] <= record["kv_bytes_full"]
        assert record["prompt_tokens"] == pytest.approx(256, rel=0.05)
    assert all(r["depth"] is not None for r in records if r["task"] == "passkey")
    compressed = [r for r in records if r["policy"] != "full"]
    assert all(r["kv_bytes_held"] < r["kv_bytes_full"] and r["reference_cached"] for r in compressed)
    assert "## passkey" in capsys.readouterr().out
    assert main(["eval", "--model", "tiny-llama", "--policies", "snapkv,streaming_llm", "--budgets", "32",
                 "--tasks", "passkey,niah_single_1", "--lengths", "256", "--workers", "1", "--threads", "1",
                 "--output-dir", str(out), "--no-progress"]) == 0
    assert len(read_records(out / "records.jsonl")) == 6  # resumed: nothing new
    assert main(["eval", "--tasks", "bogus", "--model", "tiny-llama", "--output-dir", str(out)]) == 2


def test_ray_backend_matches_local(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    local = run_sweep(_tiny_config(tmp_path, "local"), progress=False)
    assert local.ran == 2
    try:
        remote = run_sweep(_tiny_config(tmp_path, "ray", backend="ray"), progress=False)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert remote.ran == 2 and remote.failed == 0
    assert _comparable(tmp_path / "ray" / "records.jsonl") == _comparable(tmp_path / "local" / "records.jsonl")


def test_worker_processes_match_serial(tmp_path: Path) -> None:
    serial = run_sweep(_tiny_config(tmp_path, "serial", samples=2), progress=False)
    spawned = run_sweep(_tiny_config(tmp_path, "spawned", samples=2, workers=2), progress=False)
    assert serial.ran == spawned.ran == 4 and spawned.failed == 0
    assert _comparable(tmp_path / "spawned" / "records.jsonl") == _comparable(tmp_path / "serial" / "records.jsonl")


def test_another_model_or_dtype_is_refused_in_a_folder_of_records(tmp_path: Path) -> None:
    """Records are keyed by cell, not by model: a second model's sweep into the same folder used to report
    "0 cells run, N already done" and present the first model's numbers as its own."""
    out = tmp_path / "sweep"
    config = _config(tmp_path, model="tiny-llama")
    run_sweep(config, cell_fn=FakeCell(), load_model=False, progress=False)
    before = (out / "sweep.json").read_text()
    for change in ({"model": "smollm2"}, {"dtype": "bfloat16"}):
        other = _config(tmp_path, **{"model": "tiny-llama", **change})
        fake = FakeCell()
        key, value = next(iter(change.items()))
        with pytest.raises(ValueError, match=rf"holds records of {key} '.*', not '{value}'"):
            run_sweep(other, cell_fn=fake, load_model=False, progress=False)
        assert fake.calls == [] and (out / "sweep.json").read_text() == before  # nothing touched
    fresh = _config(tmp_path, model="smollm2", output_dir=str(tmp_path / "other"))
    assert run_sweep(fresh, cell_fn=FakeCell(), load_model=False, progress=False).ran > 0


def test_same_folder_spec_with_other_weights_is_refused(tmp_path: Path) -> None:
    """The fingerprint in sweep.json catches a folder whose config or weights changed under the same path."""
    from kvsieve.eval.runner import check_same_model
    from kvsieve.models.loading import model_identity

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    first = model_identity(str(folder))
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "records.jsonl").write_text("")
    config = _config(tmp_path, model="tiny-llama")
    (out / "sweep.json").write_text(json.dumps({**config.to_dict(), "model_identity": first}))
    check_same_model(out, config, first)  # same: fine
    (folder / "model.safetensors").write_bytes(b"x" * 11)
    with pytest.raises(ValueError, match="model_identity"):
        check_same_model(out, config, model_identity(str(folder)))


def test_records_missing_keys_are_skipped_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A records.jsonl line without its cell keys used to end ``eval`` and ``plot`` in a KeyError."""
    config = _config(tmp_path)
    run_sweep(config, cell_fn=FakeCell(), load_model=False, progress=False)
    path = tmp_path / "sweep" / "records.jsonl"
    good = len(read_records(path))
    with path.open("a") as fh:
        fh.write(json.dumps({"task": "vt", "policy": "snapkv"}) + "\n")  # no budget, length, sample, seed, score
        fh.write(json.dumps([1, 2]) + "\n")
        fh.write(json.dumps({"task": "vt", "policy": "snapkv", "budget": 8, "length": "long", "sample": 0,
                             "seed": 0, "score": 1.0}) + "\n")
    assert len(read_records(path)) == good
    err = capsys.readouterr().err
    assert "missing budget, length, sample, seed, score" in err and "not a JSON object" in err and "bad cell" in err
    outcome = run_sweep(config, cell_fn=FakeCell(), load_model=False, progress=False)
    assert outcome.ran == 0 and outcome.rows
    assert main(["plot", str(tmp_path / "sweep"), "--output", str(tmp_path / "plots"), "--formats", "png"]) == 0


def test_a_sweep_file_naming_a_function_needs_an_explicit_opt_in(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``model: "pkg.mod:fn"`` in a YAML file imports and calls that function: refused unless trusted."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("model: kvsieve.models.tiny:load_tiny_llama\npolicies: [snapkv]\nbudgets: [32]\n"
                     "tasks: [passkey]\nlengths: [128]\nworkers: 1\nthreads: 1\n"
                     f"output_dir: {tmp_path / 'out'}\n")
    assert main(["eval", "--config", str(sweep), "--no-progress"]) == 2
    assert "--trust-config-code" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(["eval", "--config", str(sweep), "--trust-config-code", "--no-progress"]) == 0


def test_an_output_dir_below_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fake = FakeCell()
    with pytest.raises(ValueError, match="output_dir: cannot create"):
        run_sweep(_config(tmp_path, output_dir=str(blocker / "sweep")), cell_fn=fake, load_model=False, progress=False)
    assert fake.calls == []
