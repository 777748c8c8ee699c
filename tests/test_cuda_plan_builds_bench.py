"""Smoke test of ``benchmarks/cuda_plan_builds.py`` on a tiny random model on the CPU (its figures mean something on
CUDA only; this checks that the script runs and times what it says: consecutive steps at new lengths)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from conftest import VOCAB, build_model

_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(_BENCHMARKS))  # the script imports engine_overhead beside it
    try:
        spec = importlib.util.spec_from_file_location("cuda_plan_builds_bench", _BENCHMARKS / "cuda_plan_builds.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(_BENCHMARKS))


def test_decode_and_prefill_time_new_lengths_on_a_tiny_model():
    bench = _load()
    eo = bench.eo
    model = build_model("llama")
    pool = torch.randint(3, VOCAB, (400,), generator=torch.Generator().manual_seed(0))
    settings = eo.with_random_gates(model, eo.Settings(tokens=96, budget=32, decode_policies=("snapkv", "adakv",
                                                                                             "dbtrimkv")))
    plain = eo.plain_twin(model)
    with torch.no_grad():
        decoded = bench.decode(model, plain, pool, settings, batch=1, steps=3, with_cudnn=True)
        prefilled = bench.prefill(model, plain, pool, settings)
    assert set(decoded) == {"dynamic", "dynamic_no_cudnn", "full", "snapkv", "adakv", "dbtrimkv", "snapkv_with_cudnn",
                            "adakv_with_cudnn", "dbtrimkv_with_cudnn"}
    assert all(len(times) == 3 and min(times) > 0 for times in decoded.values())
    assert set(prefilled) == {"plain", "snapkv", "snapkv_with_cudnn"} and all(len(t) == 3 for t in prefilled.values())
    from kvsieve.attention import forward

    assert forward.without_cudnn_attention.__module__ == "kvsieve.attention.backends"  # cudnn_left_on restored it
