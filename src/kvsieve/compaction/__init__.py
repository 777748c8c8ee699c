"""Compaction arithmetic: turn scores and per-head counts into the entries a head keeps."""

from kvsieve.compaction.evict import top_entries

__all__ = ["top_entries"]
