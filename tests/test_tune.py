"""``kvsieve tune``: the search space, preset files, calibration/held-out separation, the search itself.

The end-to-end runs use the 2-layer random ``tiny-llama`` (seconds per trial); what the search finds on the
default model is in ``docs/results/tune/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import get_model

import kvsieve
from kvsieve.cli import main
from kvsieve.core.part import PolicyConfigError
from kvsieve.eval.results import read_records
from kvsieve.eval.sweep_config import SweepConfigError, build_config, validate_config
from kvsieve.eval.tasks import get_task
from kvsieve.eval.tasks.text import CALIBRATION_SEEDS, HELDOUT_SEEDS, essay_pool, split_of
from kvsieve.models.default_tokenizer import load_default_tokenizer
from kvsieve.models.haystack import load_essay_texts
from kvsieve.policies.catalog import presets
from kvsieve.policies.preset_file import read_preset_file, write_preset_file
from kvsieve.tune.calibration import CALIBRATION_TASKS, CalibrationSet, groups_for
from kvsieve.tune.cli import parse_duration
from kvsieve.tune.report import Point, pareto
from kvsieve.tune.space import Composition, Space, default_choices

optuna = pytest.importorskip("optuna")


# ---------------------------------------------------------------------------------------------- space
@pytest.mark.parametrize("budget", [16, 64])
def test_every_suggested_composition_builds_and_windows_fit_the_budget(budget: int) -> None:
    space = Space.build(default_choices(), budget)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=budget))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        composition = space.suggest(trial)
        policy = kvsieve.make_policy(composition.base, budget=budget, **composition.params_dict)
        assert getattr(policy.scorer, "window", 0) <= budget
        assert (policy.scorer.name if composition.params_dict["scorer"] != "snapkv_caote" else "caote")
        seen.add(composition.params_dict["scorer"])
        study.tell(trial, 0.0)
    assert len(seen) >= 6  # the draw covers the space, not one corner of it
    combos = {(s, a, c, d) for s, a, c, d in space.valid}
    assert ("restkv", "pyramid", "evict_merge", "blockwise") in combos
    assert ("h2o", "uniform", "quantize", "decode") in combos  # side data is kept for quantized entries too
    assert ("restkv", "global", "quantize", "prefill") in combos  # a global budget in bytes


def test_composition_label_and_kind_field_parameters() -> None:
    composition = Composition("restkv", (("allocator", "pyramid"), ("allocator.beta", 7), ("scorer", "restkv"),
                                         ("action", "evict"), ("schedule", "prefill"), ("scorer.window", 16)))
    assert composition.label() == "restkv(window=16) + pyramid(beta=7) + evict @ prefill"
    policy = kvsieve.make_policy("restkv", budget=64, **composition.params_dict)
    assert policy.allocator.beta == 7 and policy.scorer.beta == 2000  # restkv's own beta untouched
    assert policy.scorer.window == 16
    with pytest.raises(PolicyConfigError, match=r"unexpected parameter 'nosuch\.beta'"):
        kvsieve.make_policy("restkv", budget=64, **{"nosuch.beta": 3})
    with pytest.raises(PolicyConfigError, match=r"allocator\.tau"):
        kvsieve.make_policy("restkv", budget=64, **{"allocator.tau": 0.5})


# ---------------------------------------------------------------------------------------------- preset files
def test_preset_file_round_trip_and_overrides(tmp_path: Path) -> None:
    params = {"scorer": "snapkv", "scorer.window": 8, "allocator": "pyramid", "allocator.beta": 5,
              "action": "evict_merge", "action.tau": 0.7, "schedule": "prefill"}
    path = write_preset_file(tmp_path / "mine.json", "mine", "snapkv", params, 24, summary="test")
    assert read_preset_file(path) == ("mine", "snapkv", params, 24)
    policy = kvsieve.make_policy(str(path))
    assert policy.name == "mine" and policy.budget == 24
    assert policy.allocator.beta == 5 and policy.action.tau == 0.7 and policy.scorer.window == 8
    assert kvsieve.make_policy(str(path), budget=40).budget == 40  # the caller's budget wins
    cache = kvsieve.KVCache(get_model("llama", "kv"), str(path))
    assert cache.policy.name == "mine" and cache.policy.allocator.name == "pyramid"


@pytest.mark.parametrize(("document", "message"), [
    ({"name": "x", "base": "snapkv", "params": {}}, "must be a JSON object with keys"),
    ({"kvsieve_preset": 2, "name": "x", "base": "snapkv", "params": {}}, "format 2"),
    ({"kvsieve_preset": 1, "name": "Bad Name", "base": "snapkv", "params": {}}, "name must be"),
    ({"kvsieve_preset": 1, "name": "x", "base": "snapkv", "params": {"a": [1]}}, "plain values"),
    ({"kvsieve_preset": 1, "name": "x", "base": "snapkv", "params": {}, "budget": 0}, "budget must be"),
    ({"kvsieve_preset": 1, "name": "x", "base": "nosuch", "params": {}}, "unknown policy 'nosuch'"),
])
def test_bad_preset_files_are_refused_with_the_reason(tmp_path: Path, document: dict, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        kvsieve.make_policy(str(path), budget=8)
    with pytest.raises(ValueError, match="does not exist"):
        kvsieve.make_policy(str(tmp_path / "missing.json"), budget=8)


def test_eval_accepts_a_preset_file(tmp_path: Path) -> None:
    path = write_preset_file(tmp_path / "p.json", "p", "snapkv", {"allocator": "pyramid"}, 32)
    config = build_config({"policies": [str(path)], "budgets": [32], "tasks": ["niah_single_1"], "lengths": [512],
                           "output_dir": str(tmp_path / "o")})
    validate_config(config)  # builds every policy × budget: the file is read there


# ---------------------------------------------------------------------------------------------- leakage
def _shingles(text: str, n: int = 12) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i:i + n]) for i in range(0, max(0, len(words) - n + 1))}


def test_calibration_and_heldout_samples_share_no_seed_and_no_haystack_text() -> None:
    """The issue's rule: what tune fits on and what a tuned preset is reported on never share a seed or a
    haystack text. Pools are disjoint; every 12-word run of a calibration prompt that occurs in an essay occurs
    in a calibration essay, and the held-out prompts never contain a run that only calibration essays hold."""
    calibration_seed, heldout_seed = CALIBRATION_SEEDS.start, HELDOUT_SEEDS.start
    assert split_of(calibration_seed) == "calibration" and split_of(heldout_seed) == "heldout"
    assert split_of(0) == split_of(1) == "standard" and set(CALIBRATION_SEEDS).isdisjoint(HELDOUT_SEEDS)
    calibration_pool, heldout_pool = set(essay_pool(calibration_seed)), set(essay_pool(heldout_seed))
    assert calibration_pool.isdisjoint(heldout_pool) and calibration_pool and heldout_pool
    essays = [" ".join(text.split()) for text in load_essay_texts()]
    only_calibration = set().union(*(_shingles(essays[i]) for i in calibration_pool))
    only_heldout = set().union(*(_shingles(essays[i]) for i in heldout_pool))
    only_calibration, only_heldout = only_calibration - only_heldout, only_heldout - only_calibration
    tokenizer = load_default_tokenizer()
    essay_tasks = [t for t in CALIBRATION_TASKS if t in ("niah_single_2", "niah_multikey_1", "niah_multivalue",
                                                         "multiturn")]
    for task in essay_tasks:
        for index in range(2):
            calibration = _shingles(get_task(task).make_sample(tokenizer, 1024, index, calibration_seed).prompt)
            heldout = _shingles(get_task(task).make_sample(tokenizer, 1024, index, heldout_seed).prompt)
            assert len(calibration & only_calibration) > 50 and not calibration & only_heldout, task
            assert len(heldout & only_heldout) > 50 and not heldout & only_calibration, task


def test_the_evaluation_refuses_calibration_seeds_and_tune_refuses_other_seeds(tmp_path: Path) -> None:
    config = build_config({"policies": ["snapkv"], "budgets": [32], "tasks": ["vt"], "lengths": [512],
                           "seed": CALIBRATION_SEEDS.start + 5, "output_dir": str(tmp_path)})
    with pytest.raises(SweepConfigError, match="calibration seed"):
        validate_config(config)
    with pytest.raises(ValueError, match="calibration seed must be in"):
        CalibrationSet(seed=HELDOUT_SEEDS.start)
    with pytest.raises(ValueError, match="calibration tasks are"):
        CalibrationSet(tasks=("passkey",))
    with pytest.raises(ValueError, match="vt: length must be"):
        CalibrationSet(tasks=("vt",), lengths=(256,))


def test_groups_put_every_trial_of_a_sample_together() -> None:
    calibration = CalibrationSet(tasks=("niah_single_1", "vt"), lengths=(512,), samples=2)
    a = Composition("snapkv", (("scorer", "snapkv"),))
    b = Composition("h2o", (("scorer", "h2o"),))
    groups = groups_for(calibration, [a, b], 32, 0, 3, with_full=True)
    assert [len(g) for g in groups] == [3, 3, 3]
    assert [(g[0].task, g[0].sample) for g in groups] == [("niah_single_1", 0), ("vt", 0), ("niah_single_1", 1)]
    assert all(g[0].policy == "full" and {c.seed for c in g} == {calibration.seed} for g in groups)


# ---------------------------------------------------------------------------------------------- report
def test_pareto_frontier_keeps_exactly_the_undominated_points() -> None:
    def point(share: float, kl: float) -> Point:
        return Point(f"{share}/{kl}", "trial", None, kl, 0.0, 0.0, share, 1.0, True)

    points = [point(0.1, 2.0), point(0.2, 1.0), point(0.15, 3.0), point(0.3, 1.0), point(0.05, 2.5),
              point(0.4, 0.5)]
    frontier = pareto(points)
    assert [(p.bytes_share, p.kl) for p in frontier] == [(0.05, 2.5), (0.1, 2.0), (0.2, 1.0), (0.4, 0.5)]
    for p in points:
        dominated = any(q.bytes_share <= p.bytes_share and q.kl <= p.kl and (q.bytes_share, q.kl) != (p.bytes_share,
                        p.kl) for q in points)
        assert (p in frontier) == (not dominated)


def test_durations() -> None:
    assert parse_duration("90") == 90 and parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400
    with pytest.raises(Exception, match="time-limit"):
        parse_duration("soon")


# ---------------------------------------------------------------------------------------------- the search
ARGS = ["tune", "--model", "tiny-llama", "--dtype", "float32", "--budget", "48", "--batch", "2", "--prune-after",
        "1", "--tasks", "niah_single_1,vt", "--lengths", "512", "--samples", "1", "--baselines", "restkv,h2o",
        "--threads", "1", "--no-progress", "--scorers", "snapkv,h2o,tova,keydiff,streaming_llm"]


def _trials(out: Path) -> list[tuple[str, str, float | None]]:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(study_name="kvsieve-tune",
                              storage=JournalStorage(JournalFileBackend(str(out / "study.journal"))))
    return [(t.state.name, t.user_attrs.get("label", ""), t.value) for t in study.trials]


def test_tune_end_to_end_deterministic_resumable_and_its_preset_works(tmp_path: Path, capsys: Any) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    assert main([*ARGS, "--trials", "3", "--output-dir", str(first)]) == 0
    records_before = len(read_records(first / "records.jsonl"))
    assert main([*ARGS, "--trials", "5", "--output-dir", str(first)]) == 0  # resumed: 2 more trials
    assert main([*ARGS, "--trials", "5", "--output-dir", str(second)]) == 0  # the same search in one go
    resumed, straight = _trials(first), _trials(second)
    evaluated = [t for t in straight if t[0] in ("COMPLETE", "PRUNED")]
    assert len(evaluated) == 5
    assert resumed[:3] == straight[:3]  # deterministic in the seed
    labels = [label for state, label, _ in resumed if state in ("COMPLETE", "PRUNED")]
    assert len(labels) == 5 and len(set(labels)) == 5  # the resumed run goes on exploring, it does not redraw
    records = read_records(first / "records.jsonl")
    keys = [(r["task"], r["policy"], json.dumps(r["params"], sort_keys=True), r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) and len(records) > records_before  # no cell evaluated twice
    # every baseline and the anchor on every calibration sample, the full reference once per sample
    assert {r["policy"] for r in records} >= {"full", "snapkv", "restkv", "h2o"}
    assert sum(r["policy"] == "full" for r in records) == 2
    report = (first / "report.md").read_text(encoding="utf-8")
    assert "## Pareto frontier" in report and "| restkv | baseline |" in report
    assert (first / "pareto.png").is_file() and (first / "trials.csv").is_file()
    preset = first / "tuned_b48.json"
    document = json.loads(preset.read_text(encoding="utf-8"))
    assert document["budget"] == 48 and document["provenance"]["calibration"]["seed"] == CALIBRATION_SEEDS.start
    best = min((t for t in resumed if t[0] == "COMPLETE"), key=lambda t: t[2])
    assert document["summary"] == best[1]
    assert document["provenance"]["score"]["kv_bytes_held_over_anchor"] <= 1.01
    # the preset runs as a --policies entry of kvsieve eval on held-out samples
    assert main(["eval", "--model", "tiny-llama", "--policies", str(preset), "--budgets", "48", "--tasks", "vt",
                 "--lengths", "512", "--seed", str(HELDOUT_SEEDS.start), "--workers", "1", "--threads", "1",
                 "--output-dir", str(tmp_path / "heldout"), "--no-progress"]) == 0
    assert {r["policy"] for r in read_records(tmp_path / "heldout" / "records.jsonl")} == {"full", str(preset)}
    capsys.readouterr()
    # a folder holds one search: another budget is refused, not mixed in
    assert main([*ARGS[:6], "64", *ARGS[7:], "--trials", "5", "--output-dir", str(first)]) == 2
    assert "holds a search with budget 48" in capsys.readouterr().err


def test_bad_settings_are_refused_before_any_work(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "bad"
    assert main([*ARGS, "--trials", "0", "--output-dir", str(out)]) == 2
    assert "--trials: must be ≥ 1" in capsys.readouterr().err
    assert main([*ARGS, "--scorers", "nosuch", "--trials", "2", "--output-dir", str(out)]) == 2
    assert "--scorers: choose one or more of" in capsys.readouterr().err
    assert not out.exists()


def test_the_ray_backend_runs_the_same_search(tmp_path: Path) -> None:
    """``--backend ray`` sends every trial's cells to Ray tasks: the same trials and values as in-process."""
    ray = pytest.importorskip("ray")
    try:
        assert main([*ARGS, "--trials", "2", "--backend", "ray", "--output-dir", str(tmp_path / "ray")]) == 0
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert main([*ARGS, "--trials", "2", "--output-dir", str(tmp_path / "local")]) == 0
    assert _trials(tmp_path / "ray") == _trials(tmp_path / "local")


def test_time_limit_and_byte_budget(tmp_path: Path) -> None:
    """``--time-limit`` ends the search after the batch running when it expires; ``--budget-bytes`` is the entries
    ``KVCache(budget_bytes=)`` would hold (2 layers' worth of keys and values per head of the tiny model)."""
    import argparse

    from kvsieve.engine.kv_cache import budget_from_bytes
    from kvsieve.models.loading import load_model
    from kvsieve.tune.cli import add_tune_arguments, tune_config

    parser = argparse.ArgumentParser()
    add_tune_arguments(parser)
    model, _ = load_model("tiny-llama", "float32", "cpu")
    args = parser.parse_args([*ARGS[1:5], "--budget-bytes", "12288", "--time-limit", "1s"])
    config = tune_config(args)
    assert config.budget == budget_from_bytes(model, {"budget_bytes": 12288})["budget"] > 0
    assert config.trials is None and config.time_limit == 1.0
    out = tmp_path / "timed"
    assert main([*ARGS, "--time-limit", "0.001", "--output-dir", str(out)]) == 0
    assert len([t for t in _trials(out) if t[0] in ("COMPLETE", "PRUNED")]) == 2  # one batch, then time is up


def test_the_shipped_tuned_preset_is_the_searched_composition():
    """``tuned_smollm2_64`` (kvsieve/parts/tuned.py) is the held-out winner's preset file, parameter for parameter."""
    named = kvsieve.make_policy("tuned_smollm2_64", budget=64)
    searched = kvsieve.make_policy(str(Path(__file__).parents[1] / "docs/results/tune/tuned_b64.json"))
    for kind in ("scorer", "allocator", "action", "selector", "schedule", "budget"):
        assert getattr(named, kind) == getattr(searched, kind), kind
    assert "tuned_smollm2_64" in presets()
