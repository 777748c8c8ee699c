"""``tova`` — Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State RNNs",
arXiv:2401.06104).

Score of entry ``j``: the attention of the *last* query only, averaged over the heads of the GQA
group (the paper averages over all heads of a layer; per-KV-head averaging keeps one selection per
KV head, METHODS.md's GQA rule). At decoding with ``schedule="decode"`` the lowest entry is dropped
each step once the budget is full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.policies.base import Policy, protect_recent
from kvsieve.policies.registry import register
from kvsieve.scores.gqa import reduce_groups


@register
@dataclass(frozen=True)
class TOVA(Policy):
    """Keep the entries the current (last) query attends to most."""

    name: ClassVar[str] = "tova"
    schedules: ClassVar[tuple[str, ...]] = ("prefill", "decode", "blockwise")

    def score(self, step: LayerStep) -> torch.Tensor:
        last_row = step.window_rows(1)[:, :, -1]
        return protect_recent(reduce_groups(last_row, step.info.num_kv_heads, "mean"), step, 0)
