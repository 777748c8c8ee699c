"""Budget arithmetic shared by allocators (the allocators themselves are in :mod:`kvsieve.parts.allocators`)."""

from kvsieve.budgets.adaptive import adaptive_counts

__all__ = ["adaptive_counts"]
