"""``full``: no compression — the reference every other policy is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvsieve.policies.base import Policy
from kvsieve.policies.registry import register


@register
@dataclass(frozen=True)
class FullCache(Policy):
    """Keep every entry. With it, outputs equal plain transformers (ratio 0 is exact)."""

    name: ClassVar[str] = "full"
    schedules: ClassVar[tuple[str, ...]] = ("prefill", "decode", "blockwise")
    evicts: ClassVar[bool] = False
    needs_budget: ClassVar[bool] = False
