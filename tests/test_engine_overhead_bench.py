"""Smoke test of ``benchmarks/engine_overhead.py`` on a tiny random model (seconds, no real model)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from conftest import VOCAB, build_model

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_overhead.py"


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("engine_overhead_bench", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_engine_overhead_runs_on_a_tiny_model():
    bench = _load()
    model = build_model("llama")  # a fresh instance: the benchmark switches it to kvsieve
    pool = torch.randint(3, VOCAB, (2 * 128,), generator=torch.Generator().manual_seed(0))
    settings = bench.Settings(tokens=128, budget=32, batches=(1, 2), rounds=2, steps=2, warmup=1,
                              prefill_tokens=128, prefill_repeats=1)
    result = bench.run_benchmark(model, pool, settings, log=lambda _line: None)
    for key in ("b1", "b2"):
        decode = result["decode"][key]
        assert set(decode["median_s"]) == {"dynamic", "snapkv", "adakv", "full"}
        assert decode["samples_per_config"] == 4
        assert decode["entries_per_head_after_prefill"]["snapkv"]["mean"] == 32
        assert decode["entries_per_head_after_prefill"]["dynamic"]["mean"] == 32
        assert decode["entries_per_head_after_prefill"]["full"]["mean"] == 32  # the same entries as dynamic
        assert set(decode["ratios"]) == {"snapkv_over_dynamic", "adakv_over_dynamic", "full_over_dynamic",
                                         "adakv_over_snapkv"}
    assert set(result["prefill"]["median_s"]) == {"plain", "snapkv", "restkv", "full"}
    assert [g["goal"] for g in result["goals"]] == [1.05, 1.10, 1.02, 1.05, 1.10, 1.02, 1.05, 1.05, 1.02]
    assert isinstance(result["all_pass"], bool)
    assert model.config._attn_implementation == "kvsieve"  # the plain twin stayed apart
    report = bench.profile_decode(build_model("llama"), pool, settings, steps=2, kind="cprofile", rows=5)
    assert "snapkv" in report and "dynamic" in report


def test_cpu_info_and_dtype():
    bench = _load()
    info = bench.cpu_info()
    assert isinstance(info["bf16_native"], bool)
    assert bench.pick_dtype(None, False)[0] == torch.float32
    assert bench.pick_dtype(None, True)[0] == torch.bfloat16
    assert bench.pick_dtype("float32", True)[0] == torch.float32


def test_engine_overhead_decodes_chosen_presets_with_their_parameters():
    """``--decode-policies`` / ``--policy-params``: each preset against the DynamicCache and snapkv, h2o evicting at
    every step (held at its budget), dbtrimkv with random gates on a random model, the settings JSON-serialisable."""
    import json

    bench = _load()
    model = build_model("llama")
    pool = torch.randint(3, VOCAB, (128,), generator=torch.Generator().manual_seed(0))
    args = bench._parse_args(["--tokens", "96", "--budget", "32", "--batches", "1", "--rounds", "1", "--steps", "3",
                              "--decode-policies", "snapkv,h2o,dbtrimkv",
                              "--policy-params", '{"h2o": {"schedule": "decode", "recent_ratio": 0.25}}'])
    settings = bench.with_random_gates(model, bench.settings_from(args))
    assert settings.decode_policies == ("snapkv", "h2o", "dbtrimkv")
    assert "gates" in settings.policy_params["dbtrimkv"] and "gates" not in settings.policy_params["h2o"]
    result = bench.run_benchmark(model, pool, settings, prefill=False, log=lambda _line: None)
    decode = result["decode"]["b1"]
    assert set(decode["ratios"]) == {"snapkv_over_dynamic", "h2o_over_dynamic", "dbtrimkv_over_dynamic",
                                     "h2o_over_snapkv", "dbtrimkv_over_snapkv"}
    assert decode["entries_per_head_after_prefill"]["h2o"] == {"mean": 32.0, "min": 32.0, "max": 32.0}
    assert result["settings"]["policy_params"] == {"h2o": {"schedule": "decode", "recent_ratio": 0.25},
                                                   "dbtrimkv": {"gates": "RetentionGates"}}
    json.dumps(result)
