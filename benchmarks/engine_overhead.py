"""Engine overhead benchmark: is decoding with a compressed cache as cheap as with a plain cache?

Acceptance criterion ("Decoding as cheap as a plain cache"): a compressed cache that holds N entries per
head must decode as fast as transformers' ``DynamicCache`` holding N entries, and compressing at prefill
must cost little next to the prefill itself. Everything runs in one process, configurations alternating,
medians compared.

**Decoding step.** For each batch size (default 1 and 8; batch 8 = eight *different* essay prompts of
the same length, so no padding) the cache states are built once:

* ``snapkv``: ``KVCache(model, "snapkv", budget=B)`` after a ``T``-token prompt (default 4096 / 256);
* ``adakv``: the same with ``adakv`` (ragged: per-head lengths differ, ``B`` per head on average);
* ``full``: ``KVCache(model, "full")`` after the same ``B``-token prompt as ``dynamic`` (kvsieve's own store
  holding everything: it must cost what the plain cache costs);
* ``dynamic``: a ``DynamicCache`` after a ``B``-token prompt (the first ``B`` tokens of the same prompts)
  on the *plain* model: an SDPA copy sharing the very same weight tensors, never touched by ``KVCache``.

So every cache holds ~``B`` entries per head and the only difference left is the engine: the kvsieve
attention, its ragged store and the per-step bookkeeping against plain SDPA on a dense cache. Each of
``--rounds`` rounds deep-copies the three filled caches (outside the timing), runs ``--warmup`` untimed
steps on each, then ``--steps`` single-token forwards ``model(token, cache=cache,
attention_mask=None, use_cache=True, logits_to_keep=1)`` per cache, *interleaved step by step* (order
rotated every step), greedy next token fed back. Every cache grows by one entry per step, so with a few
steps per round each configuration is measured at ``B`` to ``B + warmup + steps`` entries. Reported:
median seconds per step per configuration and the ratios ``snapkv/dynamic`` and ``adakv/dynamic``.

``--device cuda`` (with ``--model random-smollm2`` or ``random-llama8b``: random weights of those shapes, the
default model's weights do not travel to a GPU host) brackets every timed step and prefill with
``torch.cuda.synchronize()``; bf16 unless ``--dtype float32``.

**Prefill.** A ``--prefill-tokens`` (default ``T``) prompt at batch 1, ``--prefill-repeats`` times
(default 3), rotating between the plain model with a ``DynamicCache``, ``snapkv`` and ``restkv``
(prefill + compression, ``logits_to_keep=1``), after an untimed short warm-up of each. Ratios:
``snapkv/plain`` and ``restkv/snapkv`` (ReST-KV's reconstruction statistics must not dominate the
prefill once the model's matmuls are fast).

Goals: decode snapkv ≤ 1.05 at every batch size, adakv ≤ 1.10, full ≤ 1.02; prefill full/plain ≤ 1.02,
snapkv/plain ≤ 1.05 and
restkv/snapkv ≤ 1.05. The JSON (``benchmarks/results/engine_overhead.json``) records the CPU, whether bf16
is native there (``avx512_bf16`` / ``amx_bf16``), the dtype (bfloat16 where native, else float32 — said so in
``dtype_note``), threads, torch / transformers versions, the kvsieve source and its git commit, every
median, ratio, raw sample and sample spread, the load averages before and after each phase (other work
on the machine scatters the timings: interleaving protects the ratios only partly), and each goal with a
pass/fail flag.

``--profile [torch|cprofile]`` instead profiles ``--profile-steps`` (32) decoding steps of snapkv (and,
for contrast, of the plain DynamicCache) at batch 1 and prints the top entries, so overheads outside
SDPA show up.

``--decode-policies`` decodes other presets too (each also reported against ``snapkv``: ``X_over_snapkv``), with
keyword arguments per preset from ``--policy-params`` (JSON, e.g. ``'{"h2o": {"schedule": "decode"}}'``); on a
random-weight model ``trimkv``/``dbtrimkv`` get random gates (timing only).

On CUDA the plain model's steps run with cuDNN's SDPA kernel switched off, as kvsieve's attention runs
(:mod:`kvsieve.attention.backends`): the ratio then measures the engine, not cuDNN's plan builds. Rounds replay
the same key lengths, so they would hide those builds anyway: ``benchmarks/cuda_plan_builds.py`` times steps at new
lengths, as generation meets them.

Usage: ``python benchmarks/engine_overhead.py [--tokens 4096] [--budget 256] [--batches 1,8]
[--rounds 5] [--steps 8] [--dtype bfloat16|float32] [--threads N] [--quick]
[--decode-policies snapkv,adakv,full] [--policy-params JSON]
[--output benchmarks/results/engine_overhead.json] [--profile]``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvsieve.result_files import cpu_info
from kvsieve.transformers_adapter import cache_kwargs

RESULTS = Path(__file__).parent / "results" / "engine_overhead.json"

#: Ratio goals of the acceptance criterion.
GOAL_DECODE_SNAPKV = 1.05
GOAL_DECODE_ADAKV = 1.10
#: kvsieve's ``full`` (everything stored in its own store) against the plain ``DynamicCache`` (issue 22).
GOAL_DECODE_FULL = 1.02
GOAL_PREFILL_SNAPKV = 1.05
GOAL_PREFILL_RESTKV = 1.05

DYNAMIC = "dynamic"
DECODE_POLICIES = ("snapkv", "adakv", "full")
PLAIN = "plain"
PREFILL_POLICIES = ("snapkv", "restkv", "full")


@dataclass
class Settings:
    """What to measure (see the module docstring)."""

    tokens: int = 4096
    budget: int = 256
    batches: tuple[int, ...] = (1, 8)
    rounds: int = 5
    steps: int = 8
    warmup: int = 1
    prefill_tokens: int = 4096
    prefill_repeats: int = 3
    decode_policies: tuple[str, ...] = DECODE_POLICIES
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- machine
def pick_dtype(requested: str | None, bf16_native: bool) -> tuple[torch.dtype, str]:
    """``requested`` if given, else bfloat16 where the CPU has native bf16, else float32; and a note."""
    if requested is not None:
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[requested]
        note = f"{requested} requested with --dtype"
        if requested == "bfloat16" and not bf16_native:
            note += " (bf16 is not native on this CPU: emulated, several times slower)"
        return dtype, note
    if bf16_native:
        return torch.bfloat16, "bfloat16: native bf16 on this CPU"
    return torch.float32, "float32: bf16 is not native on this CPU (no avx512_bf16 / amx_bf16), measured in float32"


def kvsieve_source() -> dict[str, Any]:
    """Where the imported kvsieve lives, and the git commit (and dirtiness) of the repository holding it."""
    import kvsieve

    where = Path(kvsieve.__file__).resolve().parent
    info: dict[str, Any] = {"path": str(where), "commit": None, "dirty": None}
    try:
        info["commit"] = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True,
                                        text=True, check=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."],
                                capture_output=True, text=True, check=True, timeout=10).stdout
        info["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (other work on the machine inflates and scatters timings)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def spread(values: Sequence[float]) -> dict[str, float]:
    """Quartiles and extremes of timing samples (a wide spread means a noisy machine)."""
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"p25": q1, "median": q2, "p75": q3, "min": min(values), "max": max(values)}


# ---------------------------------------------------------------------------------------------- inputs
def essay_token_pool(tokenizer: Any, tokens: int) -> torch.Tensor:
    """At least ``tokens`` token ids of the essay haystack, 1-D."""
    from kvsieve.models.haystack import load_essays

    ids = tokenizer(load_essays(), add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise ValueError(f"the essays hold {len(ids)} tokens; {tokens} are needed")
    return torch.tensor(ids[:tokens])


def prompts(pool: torch.Tensor, batch: int, length: int, stride: int) -> torch.Tensor:
    """``batch`` different prompts ``(batch, length)``: row ``i`` starts at ``i * stride`` of ``pool``."""
    if (batch - 1) * stride + length > pool.numel():
        raise ValueError(f"the token pool holds {pool.numel()} tokens; {batch} prompts of {length} need more")
    return torch.stack([pool[i * stride : i * stride + length] for i in range(batch)])


def plain_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` that shares every parameter tensor (no extra weight memory) with SDPA attention.

    Must be made before ``model`` is handed to ``KVCache`` (which switches ``model`` alone to kvsieve).
    """
    memo: dict[int, Any] = {id(p): p for p in model.parameters()}
    twin = copy.deepcopy(model, memo)
    twin.set_attn_implementation("sdpa")  # type: ignore[operator]
    return twin


def make_cache(model: torch.nn.Module, policy: str, budget: int, params: dict[str, Any] | None = None) -> Any:
    """``DynamicCache`` for ``dynamic`` / ``plain``, else ``KVCache(model, policy, budget=budget, **params)``."""
    from transformers import DynamicCache

    if policy in (DYNAMIC, PLAIN):
        return DynamicCache(config=model.config)
    from kvsieve import KVCache

    if policy == "full":
        return KVCache(model, "full", **(params or {}))
    return KVCache(model, policy, budget=budget, **(params or {}))


def entries_per_head(cache: Any) -> dict[str, float]:
    """Mean / min / max entries per (layer, batch, KV head) of a filled cache."""
    from kvsieve import KVCache

    if isinstance(cache, KVCache):
        lengths = cache.head_lengths().float()
        return {"mean": float(lengths.mean()), "min": float(lengths.min()), "max": float(lengths.max())}
    length = float(max(layer.keys.shape[-2] for layer in cache.layers if layer.keys is not None))
    return {"mean": length, "min": length, "max": length}


# ---------------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA): every timed region is bracketed by it, so a GPU's asynchronous
    launches are not timed as free. Nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_step(model: torch.nn.Module, cache: Any, token: torch.Tensor) -> torch.Tensor:
    """One decoding forward (the call timed for every cache alike); the greedy next token ``(batch, 1)``. A plain
    cache on CUDA decodes with cuDNN's SDPA kernel off, as kvsieve's attention does (module docstring)."""
    from kvsieve import KVCache
    from kvsieve.attention.backends import without_cudnn_attention

    def step() -> torch.Tensor:
        return model(token, **cache_kwargs(model, cache), attention_mask=None, use_cache=True,
                     logits_to_keep=1).logits

    logits = step() if isinstance(cache, KVCache) else without_cudnn_attention(token.device, step)
    return logits[:, -1:].argmax(-1)


@dataclass
class DecodeState:
    """A filled cache to copy every round, the model that decodes it and the next token to feed."""

    model: torch.nn.Module
    cache: Any
    token: torch.Tensor


def build_state(model: torch.nn.Module, policy: str, budget: int, ids: torch.Tensor,
                params: dict[str, Any] | None = None) -> tuple[DecodeState, float]:
    """Prefill ``ids`` into a fresh cache; the state and the prefill seconds."""
    cache = make_cache(model, policy, budget, params)
    ids = ids.to(next(iter(model.parameters())).device)
    synchronize(ids.device)
    started = time.perf_counter()
    out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    flush = getattr(cache, "flush", None)
    if flush is not None:
        flush()  # kvsieve applies a prompt's compaction when the prompt ends: time it with the prefill
    synchronize(ids.device)
    elapsed = time.perf_counter() - started
    return DecodeState(model, cache, out.logits[:, -1:].argmax(-1)), elapsed


def interleaved_decode(states: dict[str, DecodeState], rounds: int, steps: int,
                       warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per decoding step of each state: ``rounds`` × ``steps`` samples, configurations interleaved
    step by step (order rotated every step), each round from a fresh deep copy of every filled cache."""
    names = list(states)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        work = {name: copy.deepcopy(state.cache) for name, state in states.items()}
        tokens = {name: state.token.clone() for name, state in states.items()}
        for name in names:
            for _ in range(warmup):
                tokens[name] = forward_step(states[name].model, work[name], tokens[name])
        for s in range(steps):
            shift = (r * steps + s) % len(names)
            for name in names[shift:] + names[:shift]:
                model, cache, token = states[name].model, work[name], tokens[name]
                synchronize(token.device)
                started = time.perf_counter()
                token = forward_step(model, cache, token)
                synchronize(token.device)
                times[name].append(time.perf_counter() - started)
                tokens[name] = token
        del work
    return times


def measure_decode(model: torch.nn.Module, plain: torch.nn.Module, pool: torch.Tensor, settings: Settings,
                   batch: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the states for one batch size and time them interleaved (see the module docstring)."""
    long_ids = prompts(pool, batch, settings.tokens, settings.tokens)
    short_ids = long_ids[:, : settings.budget].contiguous()
    states: dict[str, DecodeState] = {}
    build_s: dict[str, float] = {}
    entries: dict[str, dict[str, float]] = {}
    for policy in settings.decode_policies:
        # ``full`` keeps everything: it gets the DynamicCache's short prompt, so both hold the same entries
        ids = short_ids if policy == "full" else long_ids
        states[policy], build_s[policy] = build_state(model, policy, settings.budget, ids,
                                                      settings.policy_params.get(policy))
        entries[policy] = entries_per_head(states[policy].cache)
        log(f"  b{batch} {policy}: {settings.tokens}-token prefill {build_s[policy]:.1f} s, "
            f"entries/head {entries[policy]}")
    states[DYNAMIC], build_s[DYNAMIC] = build_state(plain, DYNAMIC, settings.budget, short_ids)
    entries[DYNAMIC] = entries_per_head(states[DYNAMIC].cache)
    order = [DYNAMIC, *settings.decode_policies]
    load_before = load_average()
    times = interleaved_decode({name: states[name] for name in order}, settings.rounds, settings.steps,
                               settings.warmup)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {f"{p}_over_dynamic": medians[p] / medians[DYNAMIC] for p in settings.decode_policies}
    if "snapkv" in medians:  # the other scoring methods against the one that holds the same entries cheapest
        ratios.update({f"{p}_over_snapkv": medians[p] / medians["snapkv"] for p in settings.decode_policies
                       if p not in ("snapkv", "full")})
    log(f"  b{batch} median ms/step: " + ", ".join(f"{k} {1000 * v:.2f}" for k, v in medians.items())
        + " | " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return {
        "batch": batch,
        "median_s": medians,
        "ratios": ratios,
        "entries_per_head_after_prefill": entries,
        "prompt_tokens": {**{p: settings.budget if p == "full" else settings.tokens for p in settings.decode_policies},
                          DYNAMIC: settings.budget},
        "build_prefill_s": build_s,
        "samples_per_config": len(times[DYNAMIC]),
        "spread_s": {name: spread(values) for name, values in times.items()},
        "load_average_before_after": [load_before, load_average()],
        "samples_ms": {name: [round(1000 * v, 4) for v in values] for name, values in times.items()},
    }


def measure_prefill(model: torch.nn.Module, plain: torch.nn.Module, pool: torch.Tensor, settings: Settings,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Plain prefill vs snapkv vs restkv prefill + compression at batch 1, rotating, medians."""
    ids = prompts(pool, 1, settings.prefill_tokens, settings.prefill_tokens)
    names = [PLAIN, *PREFILL_POLICIES]
    warm = ids[:, : min(ids.shape[1], 2 * settings.budget)]
    for name in names:  # untimed: kernels and allocator warm for every path
        build_state(plain if name == PLAIN else model, name, settings.budget, warm, settings.policy_params.get(name))
    times: dict[str, list[float]] = {name: [] for name in names}
    load_before = load_average()
    for rep in range(settings.prefill_repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            _, elapsed = build_state(plain if name == PLAIN else model, name, settings.budget, ids,
                                     settings.policy_params.get(name))
            times[name].append(elapsed)
        log(f"  prefill rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {"snapkv_over_plain": medians["snapkv"] / medians[PLAIN],
              "restkv_over_snapkv": medians["restkv"] / medians["snapkv"],
              "full_over_plain": medians["full"] / medians[PLAIN]}
    return {"prompt_tokens": settings.prefill_tokens, "batch": 1, "repeats": settings.prefill_repeats,
            "median_s": medians, "ratios": ratios, "samples_s": times,
            "spread_s": {name: spread(values) for name, values in times.items()},
            "load_average_before_after": [load_before, load_average()]}


def goals(decode: dict[str, dict[str, Any]], prefill: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each acceptance goal with its measured ratio and a pass flag."""
    out: list[dict[str, Any]] = []
    for key, result in decode.items():
        for policy, goal in (("snapkv", GOAL_DECODE_SNAPKV), ("adakv", GOAL_DECODE_ADAKV),
                             ("full", GOAL_DECODE_FULL)):
            ratio = result["ratios"].get(f"{policy}_over_dynamic")
            if ratio is not None:
                out.append({"name": f"decode {policy}/dynamic {key}", "ratio": ratio, "goal": goal,
                            "pass": ratio <= goal})
    if prefill is not None:
        for name, key, goal in (("prefill snapkv/plain", "snapkv_over_plain", GOAL_PREFILL_SNAPKV),
                                ("prefill restkv/snapkv", "restkv_over_snapkv", GOAL_PREFILL_RESTKV),
                                ("prefill full/plain", "full_over_plain", GOAL_DECODE_FULL)):
            ratio = prefill["ratios"][key]
            out.append({"name": name, "ratio": ratio, "goal": goal, "pass": ratio <= goal})
    return out


def run_benchmark(model: torch.nn.Module, pool: torch.Tensor, settings: Settings, prefill: bool = True,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Decode rounds for every batch size, then the prefill comparison, on any supported causal LM.

    ``model`` must not have been handed to ``KVCache`` yet (its plain twin is made from it first);
    ``pool`` is a 1-D tensor of at least ``max(batches) * tokens`` token ids.
    """
    plain = plain_twin(model)
    shown = {policy: {k: v if isinstance(v, (int, float, str, bool)) else type(v).__name__ for k, v in params.items()}
             for policy, params in settings.policy_params.items()}  # gates are named, not dumped
    result: dict[str, Any] = {"settings": {**asdict(replace(settings, policy_params={})), "policy_params": shown},
                              "decode": {}, "prefill": None}
    with torch.no_grad():
        warm = pool[: min(16, pool.numel())].unsqueeze(0).to(next(iter(model.parameters())).device)
        plain(warm, use_cache=False)  # page the weights in
        for batch in settings.batches:
            log(f"decode, batch {batch}")
            result["decode"][f"b{batch}"] = measure_decode(model, plain, pool, settings, batch, log)
        if prefill:
            log("prefill")
            result["prefill"] = measure_prefill(model, plain, pool, settings, log)
    result["goals"] = goals(result["decode"], result["prefill"])
    result["all_pass"] = all(goal["pass"] for goal in result["goals"])
    return result


# ---------------------------------------------------------------------------------------------- profile
def profile_decode(model: torch.nn.Module, pool: torch.Tensor, settings: Settings, steps: int = 32,
                   kind: str = "torch", rows: int = 25) -> str:
    """Profile ``steps`` batch-1 decoding steps of snapkv and, for contrast, of the plain DynamicCache.

    Each cache is first warmed up (8 untimed steps) and timed without the profiler over ``steps`` steps
    from a fresh copy, then profiled over ``steps`` steps from another fresh copy. Returns the report
    text: ms/step with and without the profiler and the top ``rows`` entries (torch: operators by self
    CPU time; cprofile: Python functions by own time).
    """
    plain = plain_twin(model)
    long_ids = prompts(pool, 1, settings.tokens, settings.tokens)
    report = io.StringIO()

    def decode(state: DecodeState, cache: Any, count: int) -> None:
        token = state.token
        for _ in range(count):
            token = forward_step(state.model, cache, token)

    with torch.no_grad():
        states = {"snapkv": build_state(model, "snapkv", settings.budget, long_ids,
                                        settings.policy_params.get("snapkv"))[0],
                  DYNAMIC: build_state(plain, DYNAMIC, settings.budget, long_ids[:, : settings.budget])[0]}
        for name, state in states.items():
            decode(state, copy.deepcopy(state.cache), 8)
            cache = copy.deepcopy(state.cache)
            started = time.perf_counter()
            decode(state, cache, steps)
            plain_ms = 1000 * (time.perf_counter() - started) / steps
            cache = copy.deepcopy(state.cache)
            started = time.perf_counter()
            if kind == "torch":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    decode(state, cache, steps)
                profiled_ms = 1000 * (time.perf_counter() - started) / steps
                averages = prof.key_averages()
                table = averages.table(sort_by="self_cpu_time_total", row_limit=rows)
                counts = sorted(((e.count, e.key) for e in averages if e.key.startswith("aten::")), reverse=True)
                total = sum(count for count, _ in counts)
                table += (f"\naten operator calls per step: {total / steps:.0f} (robust to other load); most called: "
                          + ", ".join(f"{key} {count / steps:.0f}" for count, key in counts[:12]) + "\n")
            else:
                profiler = cProfile.Profile()
                profiler.enable()
                decode(state, cache, steps)
                profiler.disable()
                profiled_ms = 1000 * (time.perf_counter() - started) / steps
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
                table = text.getvalue()
            report.write(f"\n=== {name}, batch 1, {steps} decoding steps: {plain_ms:.2f} ms/step unprofiled, "
                         f"{profiled_ms:.2f} ms/step under the {kind} profiler ===\n{table}\n")
    return report.getvalue()


# ---------------------------------------------------------------------------------------------- CLI
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length before compression")
    parser.add_argument("--budget", type=int, default=256, help="entries per head kept (and DynamicCache prompt)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration per round")
    parser.add_argument("--prefill-tokens", type=int, default=None, help="prefill prompt (default --tokens)")
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill comparison")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="default: bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--threads", type=int, default=None, help="default: torch.get_num_threads()")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA every timed region synchronises)")
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "random-smollm2", "random-llama8b"],
                        help="the default model, or random weights of its (or Llama-3.1-8B's) shapes")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 512-token prompt, budget 64, batches 1,2, 1 round of 4 steps, 1 prefill")
    parser.add_argument("--profile", nargs="?", const="torch", choices=["torch", "cprofile"], default=None,
                        help="only profile snapkv (and DynamicCache) decoding at batch 1 and print the top entries")
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--decode-policies", default=",".join(DECODE_POLICIES),
                        help="comma-separated presets decoded against the DynamicCache (and each against snapkv)")
    parser.add_argument("--policy-params", default="{}",
                        help='JSON of keyword arguments per preset, e.g. \'{"h2o": {"schedule": "decode"}}\'')
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    chosen = {"decode_policies": tuple(args.decode_policies.split(",")),
              "policy_params": json.loads(args.policy_params)}
    if args.quick:
        return Settings(tokens=512, budget=64, batches=(1, 2), rounds=1, steps=4, warmup=1, prefill_tokens=512,
                        prefill_repeats=1, **chosen)
    return Settings(tokens=args.tokens, budget=args.budget, batches=tuple(int(b) for b in args.batches.split(",")),
                    rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                    prefill_tokens=args.prefill_tokens or args.tokens, prefill_repeats=args.prefill_repeats, **chosen)


def with_random_gates(model: torch.nn.Module, settings: Settings) -> Settings:
    """Random retention gates for ``trimkv``/``dbtrimkv`` on a random-weight model (no shipped gate fits it:
    they are matched by the weights' fingerprint). The gate logits are O(1), so the ranking is not all ties;
    timing only: what they keep means nothing."""
    from kvsieve import list_policies
    from kvsieve.gates import GateConfig, RetentionGates
    from kvsieve.parts.scorers.retention import RetentionGate

    params = dict(settings.policy_params)
    for policy in settings.decode_policies:
        preset = list_policies().get(policy)
        if preset is None or not isinstance(preset.scorer, RetentionGate) or "gates" in params.get(policy, {}):
            continue
        gates = RetentionGates(GateConfig.for_model(model, tied=policy == "dbtrimkv"), init_std=0.3, seed=0)
        with torch.no_grad():
            gates.b_out.fill_(1.0)
        device = next(iter(model.parameters())).device
        params[policy] = {**params.get(policy, {}), "gates": gates.requires_grad_(False).to(device)}
    return replace(settings, policy_params=params)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import transformers

    from kvsieve import load_default_model

    cpu = cpu_info()
    device = torch.device(args.device)
    if device.type == "cuda":
        dtype, dtype_note = {"float32": torch.float32}.get(args.dtype or "", torch.bfloat16), "GPU"
    else:
        dtype, dtype_note = pick_dtype(args.dtype, cpu["bf16_native"])
    settings = settings_from(args)
    started = time.perf_counter()
    need = max(max(settings.batches) * settings.tokens, settings.prefill_tokens)
    if args.model == "smollm2" and device.type == "cpu":
        model, tokenizer = load_default_model(dtype=dtype)
        pool = essay_token_pool(tokenizer, need)
    else:  # random weights of the default model's (or Llama-3.1-8B's) shapes: weights do not travel to a GPU host
        from quantize_decode import load

        model, pool = load(args.model, dtype, device, need)
        settings = with_random_gates(model, settings)
    meta = {
        "benchmark": "engine_overhead",
        "model": "SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model,
        "dtype": str(dtype).removeprefix("torch."), "dtype_note": dtype_note, "cpu": cpu,
        "device": {"type": device.type, **({"name": torch.cuda.get_device_name(device)} if device.type == "cuda"
                                           else {})},
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(), "kvsieve": kvsieve_source(),
        "load_average_at_start": load_average(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    print(json.dumps(meta, indent=2), flush=True)
    load = meta["load_average_at_start"]
    if load is not None and load[0] > 0.5:
        print(f"warning: load average {load[0]} at start: other work on this machine scatters the timings "
              "(see load_average_* and spread_s in the JSON)", flush=True)
    if args.profile:
        print(profile_decode(model, pool, settings, args.profile_steps, args.profile))
        return
    result = run_benchmark(model, pool, settings, prefill=not args.no_prefill,
                           log=lambda line: print(line, flush=True))
    result = {**meta, **result, "load_average_at_end": load_average(), "wall_s": time.perf_counter() - started}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        "decode_median_ms": {k: {n: round(1000 * s, 3) for n, s in v["median_s"].items()}
                             for k, v in result["decode"].items()},
        "prefill_median_s": result["prefill"] and result["prefill"]["median_s"],
        "goals": [f"{g['name']}: {g['ratio']:.3f} (goal <= {g['goal']}) {'PASS' if g['pass'] else 'FAIL'}"
                  for g in result["goals"]],
        "wall_s": round(result["wall_s"], 1), "output": str(args.output),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
