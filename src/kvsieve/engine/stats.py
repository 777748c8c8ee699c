"""What a cache holds, for any cache: a ``KVCache`` or a transformers cache (``DynamicCache``...)."""

from __future__ import annotations

from typing import Any

from kvsieve.engine.kv_cache import KVCache


def cache_stats(cache: Any) -> dict[str, int]:
    """``kv_bytes`` (keys + values held), ``nbytes`` (allocated), ``peak_head_length`` (most entries per head)."""
    if isinstance(cache, KVCache):
        return {"kv_bytes": cache.kv_nbytes(), "nbytes": cache.nbytes, "peak_head_length": cache.peak_head_length()}
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)
    length = max((layer.keys.shape[-2] for layer in cache.layers if layer.keys is not None), default=0)
    return {"kv_bytes": kv, "nbytes": kv, "peak_head_length": int(length)}
