"""``kvsieve plot`` on a synthetic records file: every figure kind is written as PNG and SVG."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from kvsieve.cli import main
from kvsieve.eval.plots import plot_records

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_records() -> list[dict[str, Any]]:
    """Records shaped like ``evaluate_cell``'s: a RULER task, the passkey grid (depths), perplexity."""
    rng = random.Random(0)
    records = []
    caches = [("full", {}, None)] + [(p, q, b) for p, q in (("snapkv", {}), ("h2o", {"schedule": "decode"}))
                                     for b in (32, 64)]
    for task in ("niah_single_1", "passkey", "perplexity"):
        for length in (128, 256):
            for sample in range(3):
                for policy, params, budget in caches:
                    keep = 1.0 if budget is None else budget / 64
                    record = {
                        "task": task, "policy": policy, "params": params, "budget": budget, "length": length,
                        "sample": sample, "seed": 0, "prompt_tokens": length, "generated": "",
                        "score": float(rng.random() < keep), "answer_logprob": -1 - 6 * (1 - keep),
                        "answer_logprob_full": -1.0, "logprob_gap": 6 * (1 - keep),
                        "kl_full_compressed": 1 - keep, "kv_bytes_held": min(budget or length, length),
                        "kv_bytes_full": length, "elapsed_s": 0.1,
                    }
                    if task == "passkey":
                        record["depth"] = (0.1, 0.5, 1.0)[sample]
                    if task == "perplexity":
                        nll = [2 + 1 / (1 + i / 40) + (1 - keep) * (i > (budget or length)) for i in range(length - 1)]
                        record["nll"] = sum(nll) / len(nll)
                        record["ppl"] = math.exp(record["nll"])
                        record["nll_positions"] = nll
                    records.append(record)
    return records


def _check(paths: list[Path]) -> None:
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 5000, path
        if path.suffix == ".png":
            assert data.startswith(PNG_MAGIC)
        else:
            assert b"<svg" in data[:2000]


def test_every_figure_kind_is_written(tmp_path: Path) -> None:
    paths = plot_records(synthetic_records(), tmp_path, formats=["png"])
    names = {p.name for p in paths}
    expected = {
        "budget_niah_single_1", "budget_passkey", "budget_perplexity",
        "needle_passkey_score", "needle_passkey_logprob", "perplexity_perplexity", "suite_average",
    }
    assert names == {f"{stem}.png" for stem in expected}
    _check(paths)


def test_perplexity_without_positions_falls_back_to_length(tmp_path: Path) -> None:
    records = [r for r in synthetic_records() if r["task"] == "perplexity"]
    for record in records:
        del record["nll_positions"]
    paths = plot_records(records, tmp_path, formats=["png"])
    assert {p.name for p in paths} == {"budget_perplexity.png", "perplexity_perplexity.png"}
    _check(paths)


def test_plot_command_reads_a_sweep_folder(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    lines = [json.dumps(r) for r in synthetic_records() if r["task"] == "passkey" and r["length"] == 128]
    (sweep / "records.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["plot", str(sweep)]) == 0  # PNG and SVG by default
    written = sorted((sweep / "plots").iterdir())
    assert [p.name for p in written] == [
        f"{stem}.{fmt}" for stem in ("budget_passkey", "needle_passkey_logprob", "needle_passkey_score")
        for fmt in ("png", "svg")]
    _check(written)
    assert main(["plot", str(tmp_path / "missing")]) == 2
    with pytest.raises(ValueError, match="format"):
        plot_records(synthetic_records()[:3], tmp_path, formats=["pdf"])
