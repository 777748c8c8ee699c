"""Selectors: decoding-time subset attention without deletion (one file per method)."""

from kvsieve.parts.selectors.base import Selector
from kvsieve.parts.selectors.exact_topk import ExactTopK

SELECTORS: dict[str, type[Selector]] = {cls.name: cls for cls in (ExactTopK,)}

__all__ = ["SELECTORS", "ExactTopK", "Selector"]
