"""Budget allocators: how many entries each (layer, KV head) keeps."""

from kvsieve.budgets.adaptive import adaptive_counts

__all__ = ["adaptive_counts"]
