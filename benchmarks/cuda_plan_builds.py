"""Does a new attention shape cost a plan build on the GPU, and does kvsieve's decoding avoid it? (CUDA only.)

torch's SDPA prefers cuDNN's kernel on recent NVIDIA GPUs, and cuDNN builds an execution plan for every new shape
(``kvsieve/attention/backends.py``). Decoding meets a new key length at every step — a ragged cache one per layer —
so this benchmark times what generation meets, never a replay of lengths already seen:

* **micro**: one SDPA call (bf16, batch 8, 3 KV heads of 3 query rows, d = 64; with and without an additive mask)
  at six key lengths never used before, under torch's default choice, without cuDNN, the memory-efficient kernel
  alone, and cuDNN alone: the first call at each length and the same call again (median ms);
* **decode**: ``--steps`` consecutive greedy decoding steps after a 4,096-token prompt (``budget`` entries per head)
  of the plain model with a ``DynamicCache`` (torch's default choice, and cuDNN switched off), and of ``full`` (the
  ``budget``-token prompt), ``snapkv``, ``adakv`` and ``dbtrimkv`` (random gates) as kvsieve runs them; with
  ``--with-cudnn`` also kvsieve with cuDNN left on (``without_cudnn_attention`` made a pass-through): median ms per
  step after the first;
* **prefill**: ``snapkv`` prefill + compression at three prompt lengths never used before (4,096 + 1, 2, 3 · 17),
  as kvsieve runs it and with cuDNN left on, next to the plain model's prefill (default choice).

Usage: ``python benchmarks/cuda_plan_builds.py [--model random-smollm2] [--steps 10] [--with-cudnn]
[--output benchmarks/results/cuda_plan_builds.json]``. Random weights (the default model's weights do not travel to a
GPU host).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_overhead as eo


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _backends() -> dict[str, Callable[[], contextlib.AbstractContextManager[Any]]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return {"default": contextlib.nullcontext,
            "no_cudnn": lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                             SDPBackend.MATH]),
            "efficient": lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
            "cudnn": lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH])}


def micro(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """First call at a new key length vs the same call again, per backend choice, masked and not."""
    fresh = iter(range(1037, 10**6, 37))
    out: dict[str, Any] = {}

    def timed(*args: torch.Tensor | None) -> float:
        _sync(device)
        started = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(*args[:3], attn_mask=args[3])
        _sync(device)
        return 1000 * (time.perf_counter() - started)

    for masked in (False, True):
        for name, backend in _backends().items():
            first, again = [], []
            for _ in range(6):
                length = next(fresh)
                query = torch.randn(8, 3, 3, 64, device=device, dtype=dtype)
                keys = torch.randn(8, 3, length, 64, device=device, dtype=dtype)
                mask = torch.zeros(8, 3, 1, length, device=device, dtype=dtype) if masked else None
                if mask is not None:
                    mask[..., -3:] = float("-inf")
                with backend():
                    first.append(timed(query, keys, torch.randn_like(keys), mask))
                    again.append(timed(query, keys, torch.randn_like(keys), mask))
            key = f"{'masked' if masked else 'unmasked'}_{name}"
            out[key] = {"first_ms": statistics.median(first), "again_ms": statistics.median(again)}
            print(f"micro {key}: first call at a new length {out[key]['first_ms']:.2f} ms, again "
                  f"{out[key]['again_ms']:.3f} ms", flush=True)
    return out


@contextlib.contextmanager
def cudnn_left_on() -> Iterator[None]:
    """kvsieve's attention with cuDNN's kernel left to torch's choice (what it did before ``backends.py``)."""
    from kvsieve.attention import forward

    saved = forward.without_cudnn_attention
    forward.without_cudnn_attention = lambda device, run: run()
    try:
        yield
    finally:
        forward.without_cudnn_attention = saved


def decode(model: torch.nn.Module, plain: torch.nn.Module, pool: torch.Tensor, settings: eo.Settings, batch: int,
           steps: int, with_cudnn: bool) -> dict[str, list[float]]:
    """ms per consecutive decoding step (new key lengths at every step) per configuration."""
    device = next(iter(model.parameters())).device
    ids = eo.prompts(pool, batch, settings.tokens, settings.tokens)
    short = ids[:, : settings.budget].contiguous()
    configs: list[tuple[str, str, str | None]] = [  # label, preset, backend mode
        ("dynamic", "dynamic", None), ("dynamic_no_cudnn", "dynamic", "no_cudnn"),
        *[(p, p, None) for p in ("full", "snapkv", "adakv", "dbtrimkv")],
        *([(f"{p}_with_cudnn", p, "cudnn_on") for p in ("snapkv", "adakv", "dbtrimkv")] if with_cudnn else []),
    ]
    result: dict[str, list[float]] = {}
    for label, policy, mode in configs:
        scope = (_backends()["no_cudnn"]() if mode == "no_cudnn" else cudnn_left_on() if mode == "cudnn_on"
                 else contextlib.nullcontext())
        with scope:
            source = plain if policy == "dynamic" else model
            prompt = short if policy in ("dynamic", "full") else ids
            state, _ = eo.build_state(source, policy, settings.budget, prompt, settings.policy_params.get(policy))
            token, times = state.token, []
            for _ in range(steps):
                _sync(device)
                started = time.perf_counter()
                token = eo.forward_step(state.model, state.cache, token)
                _sync(device)
                times.append(1000 * (time.perf_counter() - started))
        result[label] = times
    print(f"decode b{batch}: ms/step median after the first: " + ", ".join(
        f"{k} {statistics.median(v[1:]):.1f}" for k, v in result.items()), flush=True)
    return result


def prefill(model: torch.nn.Module, plain: torch.nn.Module, pool: torch.Tensor, settings: eo.Settings
            ) -> dict[str, list[float]]:
    """Seconds of a prompt's prefill (+ compression) at lengths never used before."""
    times: dict[str, list[float]] = {"plain": [], "snapkv": [], "snapkv_with_cudnn": []}
    for i in range(3):
        for label in times:
            length = settings.tokens + 17 * (3 * i + list(times).index(label) + 1)
            ids = eo.prompts(pool, 1, length, length)
            with cudnn_left_on() if label.endswith("with_cudnn") else contextlib.nullcontext():
                source = plain if label == "plain" else model
                _, elapsed = eo.build_state(source, "dynamic" if label == "plain" else "snapkv", settings.budget, ids)
            times[label].append(elapsed)
    print("prefill s (median of 3 new lengths): " + ", ".join(f"{k} {statistics.median(v):.3f}"
                                                            for k, v in times.items()), flush=True)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="random-smollm2", choices=["random-smollm2", "random-llama8b"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--with-cudnn", action="store_true", help="also kvsieve with cuDNN left on (slow: ~1 s/step)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/cuda_plan_builds.json"))
    args = parser.parse_args(argv)
    import transformers
    from quantize_decode import load

    device, dtype = torch.device(args.device), torch.bfloat16
    settings = eo.Settings(tokens=4096, budget=256, decode_policies=("snapkv", "adakv", "dbtrimkv"))
    batches = [int(b) for b in args.batches.split(",")]
    model, pool = load(args.model, dtype, device, max(batches) * settings.tokens + 512)
    settings = eo.with_random_gates(model, settings)
    plain = eo.plain_twin(model)
    result: dict[str, Any] = {
        "benchmark": "cuda_plan_builds", "model": args.model, "dtype": "bfloat16",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "kvsieve": eo.kvsieve_source(), "cudnn_sdp_enabled_at_start": torch.backends.cuda.cudnn_sdp_enabled(),
        "settings": {"tokens": settings.tokens, "budget": settings.budget, "steps": args.steps, "batches": batches},
    }
    with torch.no_grad():
        result["micro"] = micro(device, dtype)
        plain(pool[:16].unsqueeze(0).to(device), use_cache=False)
        result["decode_ms"] = {f"b{b}": decode(model, plain, pool, settings, b, args.steps, args.with_cudnn)
                               for b in batches}
        result["prefill_s"] = prefill(model, plain, pool, settings)
    result["decode_median_ms"] = {b: {k: statistics.median(v[1:]) for k, v in r.items()}
                                  for b, r in result["decode_ms"].items()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["decode_median_ms"], indent=1))


if __name__ == "__main__":
    main()
