"""CAOTE / FastCAOTE — value-aware correction of any base score (Goel et al., 2025, "CAOTE: Optimizing KV
Cache Memory Through Attention Output Error-Based Token Eviction", arXiv:2504.14051).

The base scorer's unprotected score ``h`` per KV head (H2O's accumulated attention, TOVA's last-query
row, SnapKV's pooled window votes; each already reduced over its GQA group) is normalised,
``h̃ = h / Σ h`` (Sec. 3.3, App. C.1), and *replaced* by the output error of evicting each entry alone:

* CAOTE (Eq. 7): ``c_j = h̃_j / (1 - h̃_j) · ‖Σ_i h̃_i v_i - v_j‖₂²``;
* FastCAOTE (Eq. 8, ``fast=True``): ``c_j = h̃_j / (1 - h̃_j) · ‖v̄ - v_j‖₂``, ``v̄`` the plain mean of the held values.

The lowest ``c_j`` are evicted (greedy top-``b`` for multi-entry eviction, Sec. 3.2). Everything else is
the base's: the entries it protects (H2O's recent share, SnapKV's window) stay protected, its
observations (H2O's accumulators), statistics and schedules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.cache.store import SideSpec
from kvsieve.core.part import PolicyConfigError, require_bool
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.ops.reconstruction import caote_meta_scores
from kvsieve.parts.scorers.base import Scorer
from kvsieve.parts.scorers.h2o import AccumulatedAttention
from kvsieve.parts.scorers.snapkv import WindowAttention
from kvsieve.parts.scorers.tova import LastQueryAttention

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec


@dataclass(frozen=True)
class Caote(Scorer):
    """CAOTE (``fast=False``) or FastCAOTE (``fast=True``) over the score of ``base``."""

    name: ClassVar[str] = "caote"
    base: Scorer | None = None
    fast: bool = False

    def validate(self) -> None:
        if not isinstance(self.base, Scorer) or isinstance(self.base, Caote):
            raise PolicyConfigError(f"caote: base must be a (non-CAOTE) scorer; got {self.base!r}")
        require_bool(self.name, "fast", self.fast)

    @property
    def _base(self) -> Scorer:
        assert self.base is not None
        return self.base

    def schedules(self) -> tuple[str, ...]:
        return self._base.schedules()

    def needs(self) -> frozenset[str]:
        return self._base.needs()

    def side(self) -> tuple[SideSpec, ...]:
        return self._base.side()

    def protected_window(self) -> int:
        return self._base.protected_window()

    def check(self, spec: BudgetSpec) -> None:
        self._base.check(spec)

    def observe(self, step: LayerStep) -> dict[str, torch.Tensor]:
        return self._base.observe(step)

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        base = self._base.raw(step, nominal)
        return caote_meta_scores(base, step.view.values, step.view.valid, fast=self.fast)

    def score(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        base = self._base.raw(step, nominal)
        protected = self._base.protect(base, step, nominal)  # ±inf marks the base's protected and padding slots
        meta = caote_meta_scores(base, step.view.values, step.view.valid, fast=self.fast)
        return torch.where(torch.isinf(protected), protected, meta.to(protected.dtype))

    def __str__(self) -> str:
        return f"{'fastcaote' if self.fast else 'caote'}({self._base})"


def _summary(fast: bool, base: str) -> str:
    method = "FastCAOTE (mean value, Eq. 8)" if fast else "CAOTE (value-aware eviction error, Eq. 7)"
    return f"{method} over {base}"


PRESETS = tuple(
    Preset(f"{base}_{'fastcaote' if fast else 'caote'}", _summary(fast, base), scorer=Caote(base=scorer, fast=fast))
    for base, scorer in (("h2o", AccumulatedAttention()), ("tova", LastQueryAttention()), ("snapkv", WindowAttention()))
    for fast in (False, True)
)
