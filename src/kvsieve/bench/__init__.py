"""Benchmarks of compressed vs full caches: throughput, latency, prefill time, memory, KV bytes.

``kvsieve bench`` (see :mod:`kvsieve.bench.runner`) runs every configuration in a fresh subprocess
(:mod:`kvsieve.bench.worker`) with the primitives of :mod:`kvsieve.bench.measure`.
"""

from kvsieve.bench.measure import decode_tokens_per_s, make_cache, prompt_ids, timed_prefill
from kvsieve.bench.runner import BenchConfig, run_bench, summarize
from kvsieve.engine.stats import cache_stats

__all__ = [
    "BenchConfig",
    "cache_stats",
    "decode_tokens_per_s",
    "make_cache",
    "prompt_ids",
    "run_bench",
    "summarize",
    "timed_prefill",
]
