"""``exact_topk`` selector — oracle dynamic selection: at each decoding step every query head attends only
to the ``k`` entries with the largest ``q·k`` over the *whole* cache (METHODS.md; the upper bound that
Quest, SparQ and RocketKV's HSA approximate). Nothing is evicted; reading every key to rank them costs
a full pass, so this is a fidelity reference, not a speed-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.kernel import attention_logits
from kvsieve.engine.step import LayerStep
from kvsieve.parts.base import require_int
from kvsieve.parts.selectors.base import Selector


@dataclass(frozen=True)
class ExactTopK(Selector):
    """Top-``k`` keys by exact ``q·k`` per query head (selection, not eviction)."""

    name: ClassVar[str] = "exact_topk"
    k: int = 256

    def validate(self) -> None:
        require_int(self.name, "k", self.k, 1)

    def select(self, step: LayerStep) -> torch.Tensor | None:
        view = step.view
        if self.k >= view.length:
            return None
        logits = attention_logits(step.query, view.keys, step.scaling, step.bias())  # (b, kv, g, 1, L)
        if view.valid is not None:
            logits = logits.masked_fill(~view.valid[:, :, None, None, :], float("-inf"))
        top = torch.topk(logits, self.k, dim=-1).indices
        batch, q_heads = step.query.shape[0], step.query.shape[1]
        return top.reshape(batch, q_heads, self.k)
