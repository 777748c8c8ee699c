"""``exact_topk`` selector — oracle dynamic selection: at each decoding step every query head attends only to
the ``k`` entries with the largest ``q·k`` over the *whole* cache ("Exact-TopK", the oracle of RocketKV,
Behnam et al., 2025, arXiv:2502.14051, Secs. 3.1 and 4.1; the upper bound that Quest, SparQ and RocketKV's HSA
approximate). Nothing is evicted; reading every key to rank them costs a full pass, so this is a fidelity
reference, not a speed-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.selection_state import SelectionState, held_key_nbytes, record_if_measured, selected_nbytes
from kvsieve.cache.store import StoreHook
from kvsieve.core.part import require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.parts.selectors.base import Selector


@dataclass(frozen=True)
class ExactTopK(Selector):
    """Top-``k`` keys by exact ``q·k`` per query head (selection, not eviction)."""

    name: ClassVar[str] = "exact_topk"
    k: int = 256

    def validate(self) -> None:
        require_int(self.name, "k", self.k, 1)

    def hooks(self) -> list[StoreHook]:
        return [SelectionState()]  # measures traffic only

    def select(self, step: LayerStep) -> torch.Tensor | None:
        view = step.view
        store = step.store
        if self.k >= view.length:
            record_if_measured(store, store.kv_nbytes())
            return None
        batch, q_heads, _, dim = step.query.shape
        kv_heads = view.keys.shape[1]
        grouped = step.query.reshape(batch, kv_heads, q_heads // kv_heads, dim).float()
        logits = torch.matmul(grouped, view.keys.float().transpose(-1, -2)) * step.scaling  # (b, kv, g, L)
        if step.form is not None:  # soft-capping before the bias, as the model attends (sinks rank nothing)
            logits = step.form.cap(logits)
        bias = step.bias()
        if bias is not None:
            logits = logits + bias[:, :, None, :]
        if view.valid is not None:
            logits = logits.masked_fill(~view.valid[:, :, None, :], float("-inf"))
        chosen = torch.topk(logits, self.k, dim=-1).indices.reshape(batch, q_heads, self.k)
        # traffic: every held key (to rank them) plus the values of the k chosen per query head, as held
        record_if_measured(store, held_key_nbytes(store) + selected_nbytes(store, chosen, values_only=True))
        return chosen


PRESETS = (
    Preset("exact_topk", "everything in memory; each decoding query attends to its top-k q·k (selection)",
           selector=ExactTopK()),
)
