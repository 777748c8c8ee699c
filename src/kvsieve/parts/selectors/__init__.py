"""Selectors: decoding-time subset attention without deletion (one file per method)."""

from kvsieve.parts.selectors.base import Selector
from kvsieve.parts.selectors.exact_topk import ExactTopK
from kvsieve.parts.selectors.hsa import FilteredHybridSparse, HybridSparse
from kvsieve.parts.selectors.quest import Quest
from kvsieve.parts.selectors.sparq import SparQ

SELECTORS: dict[str, type[Selector]] = {cls.name: cls for cls in (ExactTopK,)}
SELECTORS.update({cls.name: cls for cls in (Quest, SparQ, HybridSparse, FilteredHybridSparse)})

__all__ = ["SELECTORS", "ExactTopK", "FilteredHybridSparse", "HybridSparse", "Quest", "Selector", "SparQ"]
