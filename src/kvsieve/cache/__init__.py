"""The compressed cache and its ragged per-head storage."""

from kvsieve.cache.kv_cache import KVCache, KVLayer
from kvsieve.cache.store import RaggedLayerStore

__all__ = ["KVCache", "KVLayer", "RaggedLayerStore"]
