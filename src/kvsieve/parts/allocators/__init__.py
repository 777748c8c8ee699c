"""Allocators: how many entries each (layer, KV head) keeps (one file per method)."""

from kvsieve.parts.allocators.adaptive import Adaptive
from kvsieve.parts.allocators.base import Allocator, Uniform
from kvsieve.parts.allocators.global_budget import GlobalBudget
from kvsieve.parts.allocators.pyramid import Pyramid
from kvsieve.parts.allocators.two_stage import TwoStageSplit

#: Allocators by name (``allocator="adaptive"`` in ``KVCache(...)``).
ALLOCATORS: dict[str, type[Allocator]] = {cls.name: cls for cls in (Uniform, Pyramid, Adaptive, GlobalBudget)}
ALLOCATORS[TwoStageSplit.name] = TwoStageSplit

__all__ = ["ALLOCATORS", "Adaptive", "Allocator", "GlobalBudget", "Pyramid", "TwoStageSplit", "Uniform"]
