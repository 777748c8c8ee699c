"""CUDA checks, skipped where no GPU is present (CI never has one; run them on a lent GPU machine).

kvsieve must be device-agnostic: every tensor on the input's device, no hidden host round trips on the
decoding hot path. On the tiny models of ``conftest.py`` moved to CUDA:

* ``full`` gives the plain ``DynamicCache``'s greedy tokens and logits (float32, ``1e-5``) on every
  architecture, and a compressed cache the same kept positions as the same cache on the CPU (float32; a
  mismatch would mean the device changes which entries a method keeps);
* every preset generates a batch with left padding on CUDA, its cache stays on CUDA and within budget;
* decoding-time compositions (mixed precision under the decode schedule, side data in tiers, a global byte budget,
  ragged heads and length groups) keep the same entries per step as on the CPU, within their byte budgets, and
  gates built on the CPU serve a CUDA model;
* a decoding step without a compaction synchronises with the host **zero** times for the caches the
  engine promises it for (counted with ``torch.cuda.set_sync_debug_mode("warn")``); the count of every other
  preset is printed (``-s``), so a lent machine's log says where round trips remain.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import pytest
import torch
from conftest import ARCHS, build_model, default_implementation
from helpers import generate, left_pad, prompt, reference_cache, with_test_gates
from test_quantize_action import _head_bytes
from test_row_independence import CharTokenizer

import kvsieve
from kvsieve.transformers_adapter import cache_kwargs

#: ``KVSIEVE_TEST_DEVICE=cpu`` runs the device-comparison tests on the CPU against itself (a dry run of the
#: module where no GPU is present).
CUDA = torch.device(os.environ.get("KVSIEVE_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
#: One preset per scorer family, allocator, action and selector.
PRESETS = ("snapkv", "adakv", "pyramidkv", "h2o", "tova", "restkv", "h2o_caote", "ems", "rocketkv", "quest",
           "sparq", "streaming_llm", "random", "dbtrimkv", "kivi", "mixed", "keydiff", "expected_attention", "cake",
           "duo_attention")
#: Presets whose decoding step (no compaction) the engine promises never to synchronise.
NO_SYNC = ("full", "snapkv", "adakv", "restkv", "streaming_llm")


def _cuda_model(arch: str) -> torch.nn.Module:
    return build_model(arch).to(CUDA)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_matches_dynamic_cache_on_cuda(arch: str) -> None:
    model, ref = _cuda_model(arch), build_model(arch, default_implementation(arch)).to(CUDA)
    ids = prompt(2, 40, seed=3).to(CUDA)
    tokens, logits = generate(model, ids, kvsieve.KVCache(model, "full"), steps=6)
    from transformers import DynamicCache

    ref_tokens, ref_logits = generate(ref, ids, DynamicCache(config=ref.config), steps=6)
    assert torch.equal(tokens, ref_tokens)
    for ours, theirs in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    _, prefill_logits = reference_cache(ref, ids)
    assert prefill_logits.device.type == CUDA.type


@pytest.mark.parametrize("policy", ("snapkv", "adakv", "restkv", "h2o", "tova", "mixed", "keydiff",
                                    "expected_attention", "cake", "kvzip"))
def test_kept_positions_match_the_cpu(policy: str) -> None:
    cpu_model, gpu_model = build_model("llama"), _cuda_model("llama")
    ids = prompt(2, 64, seed=5)
    kept = []
    for model, device in ((cpu_model, torch.device("cpu")), (gpu_model, CUDA)):
        cache = kvsieve.KVCache(model, policy, budget=32)
        model(ids.to(device), **cache_kwargs(model, cache))
        if policy == "kvzip":  # scored by repeating the prompt (probe forwards), then compressed
            kvsieve.reconstruct(model, CharTokenizer(), cache, ids.to(device))
        cache.flush()
        kept.append([cache.kept_positions(layer, b, h).cpu() for layer in range(3) for b in range(2) for h in range(2)])
    for cpu_positions, gpu_positions in zip(*kept, strict=True):
        assert torch.equal(cpu_positions, gpu_positions)


@pytest.mark.parametrize("policy", PRESETS)
def test_every_preset_generates_on_cuda(policy: str) -> None:
    """Generation with left padding runs on CUDA, keeps every entry there, and holds as many entries per head
    as the same cache on the CPU."""
    ids, mask, _ = left_pad([prompt(1, 96, seed=1)[0], prompt(1, 72, seed=2)[0]])
    lengths = []
    for device in (torch.device("cpu"), CUDA):
        model = build_model("llama").to(device)
        params = with_test_gates(model, policy, {"budget": 40})
        if "gates" in params:
            params["gates"] = params["gates"].to(device)
        cache = kvsieve.KVCache(model, policy, **params)
        tokens, _ = generate(model, ids.to(device), cache, steps=8, attention_mask=mask.to(device))
        assert tokens.device.type == device.type and tokens.shape == (2, 104)
        for layer in cache.layers:
            assert layer.store.keys.device.type == device.type
            for tier in layer.store.tiers:
                assert tier.key_codes.device.type == device.type
        lengths.append(cache.head_lengths())
    assert torch.equal(lengths[0], lengths[1])


def _count_syncs(run: Callable[[], object]) -> tuple[int, list[str]]:
    """Host synchronisations while ``run()`` runs, and where (file:line) they happen."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), sorted({f"{w.filename}:{w.lineno}" for w in syncs})


def _syncs_per_step(policy: str, steps: int = 4, **extra) -> tuple[float, list[str], kvsieve.KVCache]:
    model = _cuda_model("llama")
    params = with_test_gates(model, policy, {} if policy == "full" else {"budget": 40, **extra})
    if "gates" in params:
        params["gates"] = params["gates"].to(CUDA)
    cache = kvsieve.KVCache(model, policy, **params)
    ids = prompt(2, 96, seed=4).to(CUDA)
    out = model(ids, **cache_kwargs(model, cache), use_cache=True)
    cache.flush()
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(2):  # warm: lazily built state
        token = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)

    def decode() -> None:
        nonlocal token
        for _ in range(steps):
            token = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)

    count, where = _count_syncs(decode)
    return count / steps, where, cache


@pytest.mark.parametrize("policy", PRESETS)
def test_prefill_host_reads_are_counted(policy: str) -> None:
    """Prints how often a 600-token prefill + compression (several blocks of the statistics pass) waits for the
    device, and where, so a lent machine's log says which prefill round trips remain; asserts only that the
    prefill evicted to budget on the device."""
    if CUDA.type != "cuda":
        pytest.skip("counts CUDA synchronisations")
    model = _cuda_model("llama")
    params = with_test_gates(model, policy, {"budget": 64})
    if "gates" in params:
        params["gates"] = params["gates"].to(CUDA)
    cache = kvsieve.KVCache(model, policy, **params)
    ids = prompt(1, 600, seed=4).to(CUDA)

    def prefill() -> None:
        model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        cache.flush()

    count, where = _count_syncs(prefill)
    print(f"\nSYNCS-PREFILL {policy}: {count} per prefill at {where}")
    assert cache.kept_positions(0, 0, 0).device.type == "cuda"
@pytest.mark.parametrize("policy", ("full", *PRESETS))
def test_decoding_steps_do_not_synchronise(policy: str) -> None:
    if CUDA.type != "cuda":
        pytest.skip("counts CUDA synchronisations")
    per_step, where, _ = _syncs_per_step(policy)
    print(f"\nSYNCS {policy}: {per_step:.2f} per decoding step at {where}")
    if policy in NO_SYNC:
        assert per_step == 0, where


@pytest.mark.parametrize("policy", ("h2o", "tova"))
def test_every_step_eviction_host_reads_are_counted(policy: str) -> None:
    """Prints the host synchronisations per decoding step of ``schedule="decode"`` eviction (one entry dropped per
    head and step; the drop-one plan reads nothing back since session 23, unverified on a GPU), so a lent machine's
    log says what is left; asserts that every head held exactly its budget after each step's eviction, on the
    device."""
    if CUDA.type != "cuda":
        pytest.skip("counts CUDA synchronisations")
    per_step, where, cache = _syncs_per_step(policy, schedule="decode")
    print(f"\nSYNCS {policy} schedule=decode: {per_step:.2f} per decoding step at {where}")
    assert cache.layers[0].store.keys.device.type == "cuda"
    assert (cache.head_lengths() == 40).all()


@pytest.mark.parametrize("policy", ("h2o", "ems"))
def test_fused_statistics_on_cuda(policy: str, monkeypatch) -> None:
    """The one-pass output + column sums on the device (forced: the engine fuses on the CPU only): the same kept
    positions as SDPA + a second pass, and logits within 1e-5 (float32)."""
    from kvsieve.engine.engine import Engine

    model = _cuda_model("llama")
    ids = prompt(2, 96, seed=6).to(CUDA)
    results = []
    for fused in (True, False):
        # every prompt forward of these 96-token prompts can evict (budget 40): fused, or not at all
        monkeypatch.setattr(Engine, "_fuses_statistics", lambda self, call, step, on=fused: on and step.q_len > 1)
        cache = kvsieve.KVCache(model, policy, budget=40, fuse_statistics=fused)
        logits = model(ids, **cache_kwargs(model, cache)).logits
        cache.flush()
        kept = [cache.kept_positions(layer, b, h).cpu() for layer in range(3) for b in range(2) for h in range(2)]
        results.append((logits, kept))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


#: Decoding-time compositions added since the last GPU run: mixed precision under the decode schedule (group-aware
#: plan), scorers' side data in quantized tiers (h2o), a global byte budget with mixed precision (dbtrimkv), ragged
#: caches decoded by length groups (adakv, kvzip after its reconstruction, DuoAttention's head split).
DECODING = {
    "mixed_decode": ("mixed", {"scorer": "tova", "budget": 24, "group": 4, "value_group": 8, "schedule": "decode",
                               "buffer": 6}),
    "h2o_quantized": ("h2o", {"budget": 24, "action": "quantize", "bits": 4, "low_share": 0.5, "group": 4,
                              "value_group": 8, "schedule": "decode", "buffer": 3}),
    "dbtrimkv_global_mixed": ("dbtrimkv", {"budget": 20, "allocator": "global", "action": "quantize", "bits": 4,
                                           "low_share": 0.5, "group": 4, "value_group": 8, "schedule": "decode",
                                           "buffer": 2}),
    "adakv": ("adakv", {"budget": 24, "window": 8}),
    "kvzip": ("kvzip", {"budget": 24}),
    "duo_attention": ("duo_attention", {"budget": 24}),
    # selectors over quantized tiers (pages, sums and traffic from the combined view; session 13)
    "rocketkv_quantized": ("rocketkv", {"budget": 24, "window": 4, "action": "quantize", "bits": 4, "low_share": 0.5,
                                        "group": 4, "value_group": 8}),
    "mixed_sparq": ("mixed", {"budget": 24, "window": 4, "selector": "sparq", "group": 4, "value_group": 8}),
}


@pytest.mark.parametrize("name", DECODING)
def test_decoding_compositions_match_the_cpu(name: str) -> None:
    """The same tokens fed to the same cache on the CPU and on CUDA (float32, teacher-forced so that rounding cannot
    change the inputs): the same kept positions per head after every step and logits within 1e-4; quantized
    compositions hold at most the bytes of ``budget + buffer`` full entries per head (per row over all heads for the
    global budget) at every step on the device too."""
    policy, params = DECODING[name]
    ids, fed = prompt(2, 72, seed=5), prompt(2, 12, seed=7)
    runs = []
    for device in (torch.device("cpu"), CUDA):
        model = build_model("llama").to(device)
        # gates built on the CPU for a CUDA model: the cache binds a copy on the model's device
        full = with_test_gates(build_model("llama"), policy, dict(params))
        cache = kvsieve.KVCache(model, policy, **full)
        logits = [model(ids.to(device), **cache_kwargs(model, cache)).logits[:, -1].cpu()]
        if policy == "kvzip":
            kvsieve.reconstruct(model, CharTokenizer(), cache, ids.to(device))
        kept = []
        for step in range(fed.shape[1]):
            logits.append(model(fed[:, step:step + 1].to(device), **cache_kwargs(model, cache)).logits[:, -1].cpu())
            kept.append([cache.kept_positions(layer, b, h).cpu() for layer in range(3) for b in range(2)
                         for h in range(2)])
            stores = [layer.store for layer in cache.layers]
            assert all(store.keys.device.type == device.type for store in stores)
            if ("action" in params or policy == "mixed") and "buffer" in params:  # compacting while decoding
                per_full = 2 * stores[0].head_dim * stores[0].keys.element_size()
                held = [_head_bytes(store) for store in stores]
                limit = (params["budget"] + params["buffer"]) * per_full
                if params.get("allocator") == "global":
                    rows = sum(h.view(s.batch, s.heads).sum(dim=1) for h, s in zip(held, stores, strict=True))
                    assert int(rows.max()) <= limit * sum(s.heads for s in stores), (device, step)
                else:
                    assert max(int(h.max()) for h in held) <= limit, (device, step)
        runs.append((logits, kept))
    (cpu_logits, cpu_kept), (gpu_logits, gpu_kept) = runs
    for ours, theirs in zip(cpu_logits, gpu_logits, strict=True):
        torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    for step, (cpu_step, gpu_step) in enumerate(zip(cpu_kept, gpu_kept, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(cpu_step, gpu_step, strict=True)), step


def test_kvsieve_attention_runs_without_cudnn_on_cuda(monkeypatch) -> None:
    """Every SDPA call of a kvsieve decoding step (a ragged ``adakv`` cache: masked, a new key length per layer) runs
    with cuDNN's kernel switched off — it would build a plan per new shape (``attention/backends.py``) — and the flag
    is back on afterwards; a plain model's own attention keeps torch's choice."""
    if CUDA.type != "cuda":
        pytest.skip("cuDNN's SDPA kernel is a CUDA backend")
    model = _cuda_model("llama")
    cache = kvsieve.KVCache(model, "adakv", budget=40)
    ids = prompt(2, 96, seed=4).to(CUDA)
    token = model(ids, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    model(token, **cache_kwargs(model, cache), use_cache=True)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    seen.clear()
    plain = build_model("llama").to(CUDA)
    plain(ids)
    assert seen and all(seen)
