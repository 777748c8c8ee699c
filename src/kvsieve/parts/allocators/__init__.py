"""Allocators: how many entries each (layer, KV head) keeps (one file per method).

Each file registers its parts and ends with its presets (see :mod:`kvsieve.policies.catalog`)."""
