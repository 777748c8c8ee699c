"""Measurement primitives: essay prompts, caches, timed prefill and decoding, cache sizes, process RSS.

The full cache is transformers' ``DynamicCache``; through the kvsieve attention function (or plain SDPA
on a model no ``KVCache`` has touched) it is exactly the uncompressed baseline. Every timed forward runs with cuDNN's
SDPA kernel off on CUDA, as kvsieve's attention does (:mod:`kvsieve.attention.backends`), so the baseline and the
compressed caches use the same kernels.
"""

from __future__ import annotations

import re
import resource
import time
from typing import Any

import torch
from transformers import DynamicCache

from kvsieve.attention.backends import cudnn_attention_off
from kvsieve.engine.kv_cache import KVCache
from kvsieve.models.haystack import load_essays
from kvsieve.transformers_adapter import cache_kwargs

FULL = "full"


def prompt_ids(tokenizer: Any, tokens: int, batch: int = 1) -> torch.Tensor:
    """The first ``tokens`` tokens of the essays, repeated ``batch`` times: ``(batch, tokens)``."""
    text = load_essays()
    chars = 6 * tokens + 256
    while True:  # tokenize a prefix only (the whole haystack takes seconds); grow it until long enough
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens + 16 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < tokens:
        raise ValueError(f"the essay haystack has {len(ids)} tokens; cannot build a {tokens}-token prompt")
    return torch.tensor([ids[:tokens]] * batch)


def make_cache(model: torch.nn.Module, policy: str, budget: int | None, params: dict[str, Any] | None = None) -> Any:
    """``DynamicCache`` for ``full``, else ``KVCache(model, policy, budget=budget, **params)``."""
    if policy == FULL:
        return DynamicCache(config=model.config)
    return KVCache(model, policy, budget=budget, **(params or {}))


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_prefill(model: torch.nn.Module, ids: torch.Tensor, cache: Any) -> tuple[float, torch.Tensor]:
    """Seconds for the prompt forward (with compression), and the greedy next token ``(batch, 1)``."""
    _synchronize(ids.device)
    start = time.perf_counter()
    with cudnn_attention_off(ids.device):
        out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        if isinstance(cache, KVCache):
            cache.flush()  # the prompt's compaction (it would otherwise run at the first decoding step)
    _synchronize(ids.device)
    return time.perf_counter() - start, out.logits[:, -1:].argmax(-1)


def decode_latencies(
    model: torch.nn.Module, cache: Any, token: torch.Tensor, steps: int
) -> tuple[list[float], torch.Tensor]:
    """Greedy-decode ``steps`` tokens one forward at a time; seconds per step and the last token."""
    latencies = []
    with cudnn_attention_off(token.device):
        for _ in range(steps):
            start = time.perf_counter()
            token = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
            _synchronize(token.device)
            latencies.append(time.perf_counter() - start)
    return latencies, token


def decode_tokens_per_s(model: torch.nn.Module, cache: Any, token: torch.Tensor, steps: int) -> float:
    """Decoding throughput in tokens/s (all batch rows counted)."""
    latencies, _ = decode_latencies(model, cache, token, steps)
    return steps * token.shape[0] / sum(latencies)


def _status_kib(field: str) -> int | None:
    try:
        text = open("/proc/self/status", encoding="ascii").read()  # noqa: SIM115
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def rss_bytes() -> int | None:
    """Current resident set size (Linux ``VmRSS``), None where unavailable."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since start or the last :func:`reset_peak_rss` (``VmHWM``; else ``ru_maxrss``)."""
    kib = _status_kib("VmHWM")
    return (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` (and so ``ru_maxrss``) to the current RSS (Linux ``clear_refs`` 5); False where not
    supported. Read :func:`peak_rss_bytes` first to keep the whole-process peak."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False
