"""Storage: one layer's ragged keys, values, positions and side data (``LayerStore``) and its hooks.

``KVCache``, which owns an engine and these stores, is :class:`kvsieve.engine.kv_cache.KVCache`.
"""
