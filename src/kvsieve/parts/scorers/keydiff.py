"""``keydiff`` scorer (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments", arXiv:2504.15364).

Score of entry ``j`` of a KV head: the negative cosine similarity of its key to the head's *anchor*, the mean
of the L2-normalised keys the head holds (Sec. 3, Eq. 4–5: keys far from the mean direction are the
distinctive ones, and they are the ones attention picks out)::

    a = mean_j k_j / ‖k_j‖,     s_j = −cos(k_j, a)

No attention weights are read, so the score works with any attention kernel and costs one pass over the
held keys. The mean runs over the real entries of each (batch row, KV head) only (padding slots are left
out), so a row scores as it would alone. As in the public reference (kvpress ``KeyDiffPress``) nothing is
protected by default; ``window`` keeps the newest entries (e.g. a question) when composed with a budget
that must never lose them. The paper compresses block by block while the prompt is read: that is the
``blockwise`` schedule (``KVCache(model, "keydiff", schedule="blockwise", block_size=…)``); at decoding the
score is re-evaluated over what is held, so ``schedule="decode"`` works too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.core.part import require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer

#: Norm floor of a key before normalising (``F.normalize``'s default eps).
NORM_EPS = 1e-12


def key_anchor_dissimilarity(keys: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``−cos(k_j, a)`` ``(batch, heads, L)`` with ``a`` the mean unit key of each (row, head)'s real entries.

    Computed in float32; padding slots (``valid`` False) neither enter the mean nor get a meaningful score
    (the scorer's protection masks them).
    """
    k = keys.float()
    unit = k / k.norm(dim=-1, keepdim=True).clamp(min=NORM_EPS)
    if valid is None:
        anchor = unit.mean(dim=2, keepdim=True)
    else:
        weights = valid.unsqueeze(-1).to(unit.dtype)
        anchor = (unit * weights).sum(dim=2, keepdim=True) / weights.sum(dim=2, keepdim=True).clamp(min=1.0)
    anchor_unit = anchor / anchor.norm(dim=-1, keepdim=True).clamp(min=NORM_EPS)
    return -(unit * anchor_unit).sum(dim=-1)


@dataclass(frozen=True)
class KeyDiff(Scorer):
    """Keys least similar to the head's mean key direction first; no attention needed."""

    name: ClassVar[str] = "keydiff"
    SCHEDULES: ClassVar[tuple[str, ...]] = ALL_SCHEDULES
    window: int = 0

    def validate(self) -> None:
        require_int(self.name, "window", self.window, 0)

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        view = step.view
        return key_anchor_dissimilarity(view.keys, view.valid)


PRESETS = (
    Preset("keydiff", "keys least similar to the mean key direction (no attention scores needed)",
           scorer=KeyDiff()),
)
