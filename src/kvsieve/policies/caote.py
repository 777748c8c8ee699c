"""CAOTE / FastCAOTE — value-aware meta-policy over a base score (Goel et al. 2025, "CAOTE: KV Cache
Selection for LLMs via Attention Output Error-Based Token Eviction", ``papers/caote.txt``).

The base policy's score ``h`` per KV head (H2O's accumulated attention, TOVA's last-query row, SnapKV's
pooled window votes; each already reduced over its GQA group) is normalised, ``h̃ = h / Σ h`` (Sec. 3.3,
App. C.1), and *replaced* by the output error of evicting each entry alone:

* CAOTE (Eq. 7): ``c_j = h̃_j / (1 - h̃_j) · ‖Σ_i h̃_i v_i - v_j‖₂²``;
* FastCAOTE (Eq. 8): ``c_j = h̃_j / (1 - h̃_j) · ‖v̄ - v_j‖₂``, ``v̄`` the plain mean of the held values.

The lowest ``c_j`` are evicted (greedy top-``b`` for multi-entry eviction, Sec. 3.2). Everything else is
the base's: the entries it protects (H2O's recent share, SnapKV's window) stay protected, its
observations (H2O's accumulators) and its schedules — each class here subclasses its base, so a schedule
added to the base (e.g. the block-wise prefill the paper uses) is inherited without a change here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.policies.base import Policy
from kvsieve.policies.h2o import ACCUMULATOR, H2O
from kvsieve.policies.registry import register
from kvsieve.policies.snapkv import SnapKV
from kvsieve.policies.tova import TOVA
from kvsieve.scores.gqa import reduce_groups
from kvsieve.scores.reconstruction import caote_meta_scores


@dataclass(frozen=True)
class CaoteMeta(Policy):
    """CAOTE over the score of the next class in the MRO (its base policy); not registered itself.

    Subclasses set ``base`` (the base policy's name), ``fast`` (FastCAOTE) and :meth:`base_scores`.
    """

    base: ClassVar[str] = ""
    fast: ClassVar[bool] = False

    def base_scores(self, step: LayerStep) -> torch.Tensor:
        """The base policy's unprotected score ``h`` ``(batch, kv_heads, L)``, ≥ 0."""
        raise NotImplementedError(f"{type(self).__name__} must implement base_scores()")

    def score(self, step: LayerStep) -> torch.Tensor:
        protected = super().score(step)  # the base's score: ±inf marks its protected and padding slots
        meta = caote_meta_scores(self.base_scores(step), step.view.values, step.view.valid, fast=self.fast)
        return torch.where(torch.isinf(protected), protected, meta.to(protected.dtype))


@dataclass(frozen=True)
class _H2OBase(CaoteMeta, H2O):
    base: ClassVar[str] = "h2o"

    def base_scores(self, step: LayerStep) -> torch.Tensor:
        return step.store.dense().extras[ACCUMULATOR]


@dataclass(frozen=True)
class _TOVABase(CaoteMeta, TOVA):
    base: ClassVar[str] = "tova"

    def base_scores(self, step: LayerStep) -> torch.Tensor:
        return reduce_groups(step.window_rows(1)[:, :, -1], step.info.num_kv_heads, "mean")


@dataclass(frozen=True)
class _SnapKVBase(CaoteMeta, SnapKV):
    base: ClassVar[str] = "snapkv"

    def base_scores(self, step: LayerStep) -> torch.Tensor:
        return self.raw_scores(step)


@register
@dataclass(frozen=True)
class H2OCaote(_H2OBase):
    """H2O accumulators → CAOTE (Eq. 7)."""

    name: ClassVar[str] = "h2o_caote"


@register
@dataclass(frozen=True)
class H2OFastCaote(_H2OBase):
    """H2O accumulators → FastCAOTE (Eq. 8)."""

    name: ClassVar[str] = "h2o_fastcaote"
    fast: ClassVar[bool] = True


@register
@dataclass(frozen=True)
class TOVACaote(_TOVABase):
    """TOVA's last-query attention → CAOTE (Eq. 7)."""

    name: ClassVar[str] = "tova_caote"


@register
@dataclass(frozen=True)
class TOVAFastCaote(_TOVABase):
    """TOVA's last-query attention → FastCAOTE (Eq. 8)."""

    name: ClassVar[str] = "tova_fastcaote"
    fast: ClassVar[bool] = True


@register
@dataclass(frozen=True)
class SnapKVCaote(_SnapKVBase):
    """SnapKV's pooled window votes → CAOTE (Eq. 7)."""

    name: ClassVar[str] = "snapkv_caote"


@register
@dataclass(frozen=True)
class SnapKVFastCaote(_SnapKVBase):
    """SnapKV's pooled window votes → FastCAOTE (Eq. 8)."""

    name: ClassVar[str] = "snapkv_fastcaote"
    fast: ClassVar[bool] = True
