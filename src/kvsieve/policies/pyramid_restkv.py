"""``pyramid_restkv`` — ReST-KV scores with PyramidKV's layer budgets (ReST-KV, Chen et al. 2025,
``papers/restkv.txt``, App. C, Table 5; PyramidKV, Cai et al. 2024, arXiv:2406.02069).

Scores are :class:`~kvsieve.policies.restkv.RestKV`'s (Eq. 7, 9, 13) with all its fields; layer ``l``
keeps PyramidKV's linearly decreasing budget (``min = (B - w)/β_p``, ``max = 2(B - w) - min``,
``β_p = 20``: ``pyramid_beta``, renamed because ``beta`` is ReST-KV's AWS scale). The AWS top-``B`` of
Eq. 10 uses the layer's own budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvsieve.policies.base import PolicyConfigError, is_int
from kvsieve.policies.pyramidkv import PyramidKV
from kvsieve.policies.registry import register
from kvsieve.policies.restkv import RestKV


@register
@dataclass(frozen=True)
class PyramidRestKV(RestKV):
    """ReST-KV with a pyramidal (linearly decreasing) layer budget."""

    name: ClassVar[str] = "pyramid_restkv"
    schedules: ClassVar[tuple[str, ...]] = tuple(s for s in RestKV.schedules if s in PyramidKV.schedules)
    pyramid_beta: int = 20

    def validate(self) -> None:
        super().validate()
        if self.budget is None:
            raise PolicyConfigError(f"{self.name}: needs an absolute budget (int ≥ 1), not a ratio")
        if not is_int(self.pyramid_beta) or self.pyramid_beta < 1:
            raise PolicyConfigError(f"{self.name}: pyramid_beta must be an int ≥ 1; got {self.pyramid_beta!r}")

    def layer_budget(self, layer_idx: int, num_layers: int) -> int:
        pyramid = PyramidKV(budget=self.budget, window=self.window, beta=self.pyramid_beta)
        return pyramid.layer_budget(layer_idx, num_layers)
