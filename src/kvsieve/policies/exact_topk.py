"""``exact_topk`` — oracle dynamic selection: at each decoding step every query head attends only to
the ``budget`` entries with the largest ``q·k`` over the *whole* cache (METHODS.md; the upper bound
that Quest, SparQ and RocketKV's HSA approximate). Nothing is evicted: memory equals the full cache;
only the attention is sparse. Prefill attention is dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.compaction.select import topk_attention
from kvsieve.policies.base import Policy, PolicyConfigError
from kvsieve.policies.registry import register


@register
@dataclass(frozen=True)
class ExactTopK(Policy):
    """Selection, not eviction: top-``budget`` keys per query head at every decoding step."""

    name: ClassVar[str] = "exact_topk"
    evicts: ClassVar[bool] = False

    def validate(self) -> None:
        super().validate()
        if self.budget is None:
            raise PolicyConfigError("exact_topk: needs budget (int ≥ 1): the number of keys each query attends to")

    def decode_attention(self, step: LayerStep) -> torch.Tensor | None:
        assert self.budget is not None
        view = step.view
        return topk_attention(step.query, view.keys, view.values, view.valid, self.budget, step.scaling)
