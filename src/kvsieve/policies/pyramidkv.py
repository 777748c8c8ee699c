"""``pyramidkv`` (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling", arXiv:2406.02069).

SnapKV scores; per-layer budgets decrease linearly from the bottom layer to the top with the same
total: ``min = (B - w) / β``, ``max = 2 (B - w) - min``, layer ``l`` keeps
``⌊max - l · (max - min) / (L - 1)⌋ + w`` entries per head, β = 20. The reference code rounds the
step down, which can push the total above ``L·B``; flooring each exact layer budget keeps the total
at or below ``L·B`` (equal up to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvsieve.policies.base import PolicyConfigError, is_int
from kvsieve.policies.registry import register
from kvsieve.policies.snapkv import SnapKV


@register
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV with a pyramidal (linearly decreasing) layer budget."""

    name: ClassVar[str] = "pyramidkv"
    beta: int = 20

    def validate(self) -> None:
        super().validate()
        if self.budget is None:
            raise PolicyConfigError("pyramidkv: needs an absolute budget (int ≥ 1), not a ratio")
        if not is_int(self.beta) or self.beta < 1:
            raise PolicyConfigError(f"pyramidkv: beta must be an int ≥ 1; got {self.beta!r}")

    def layer_budget(self, layer_idx: int, num_layers: int) -> int:
        assert self.budget is not None
        if num_layers == 1:
            return self.budget
        spare = self.budget - self.window
        low = spare / self.beta
        high = 2 * spare - low
        return int(high - layer_idx * (high - low) / (num_layers - 1)) + self.window
