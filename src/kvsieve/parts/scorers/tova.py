"""``tova`` scorer — Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State RNNs",
arXiv:2401.06104).

Score of entry ``j``: the attention of the *last* query only. ``heads="layer"`` (default, the official
code: ``attn_weights[:, :, -1, :]`` averaged over every query head of the layer, one kept set shared by
all KV heads) or ``heads="group"`` (kvsieve ≤ 0.1: averaged over each GQA group, one set per KV head).
Nothing is protected: the newest token competes like any other (as in the official code). The layer
average needs every head of a row to hold the same positions — TOVA's own selection keeps it so; when
another part made the heads ragged, the score falls back to the per-group average.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.core.part import require_choice
from kvsieve.core.preset import Preset
from kvsieve.core.step import WINDOW_ROWS, LayerStep
from kvsieve.ops.gqa import reduce_groups
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer


@dataclass(frozen=True)
class LastQueryAttention(Scorer):
    """Keep the entries the current (last) query attends to most."""

    name: ClassVar[str] = "tova"
    SCHEDULES: ClassVar[tuple[str, ...]] = ALL_SCHEDULES
    NEEDS: ClassVar[frozenset[str]] = frozenset({WINDOW_ROWS})
    heads: str = "layer"

    def validate(self) -> None:
        require_choice(self.name, "heads", self.heads, ("layer", "group"))

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        last_row = step.window_rows(1)[:, :, -1]
        per_group = reduce_groups(last_row, step.kv_heads, "mean")
        if self.heads == "group":
            return per_group
        shared = last_row.mean(dim=1, keepdim=True).expand(-1, step.kv_heads, -1)
        aligned = _rows_with_aligned_heads(step)  # decided per row: rows are independent requests
        return torch.where(aligned[:, None, None], shared, per_group)

    def scores_from_row(self, rows: torch.Tensor, kv_heads: int) -> torch.Tensor | None:
        last_row = rows[:, :, -1]  # the same reductions as raw's, of the same row
        if self.heads == "group":
            return reduce_groups(last_row, kv_heads, "mean")
        return last_row.mean(dim=1, keepdim=True)  # shared: raw's where the row's heads are aligned


def _rows_with_aligned_heads(step: LayerStep) -> torch.Tensor:
    """``(batch,)``: every KV head of the row holds the same positions (an average over all heads is per token)."""
    view = step.view
    same = view.positions == view.positions[:, :1]
    if view.valid is not None:
        same = same & (view.valid == view.valid[:, :1])
    return same.flatten(1).all(dim=1)


PRESETS = (Preset("tova", "attention of the last query (all heads of the layer)", scorer=LastQueryAttention()),)
