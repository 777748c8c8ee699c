"""One layer's forward call as one value: what the attention function handed the engine, resolved once.

The registered attention function gives the engine a layer, its module, the queries, the mask and the
attention form; the engine takes the layer's pending keys and values, the padding and the captured layer
inputs, and from then on every step of that forward (append, attend, observe, plan, act) reads the same
:class:`LayerCall` instead of nine loose arguments. It is built once per layer and forward (once per
block under the ``blockwise`` schedule), so it costs one small slotted object per layer per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from kvsieve.attention.kernel import AttentionForm
from kvsieve.cache.store import LayerStore


class LayerState(Protocol):
    """What the engine needs from a cache layer (``kvsieve.engine.kv_cache.KVLayer``)."""

    layer_idx: int
    left_alone: bool
    store: LayerStore | None
    seen: int
    forwards: int

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def take_layer_inputs(self) -> torch.Tensor | None: ...


@dataclass(frozen=True, slots=True)
class LayerCall:
    """One forward (or one block of it) of one layer, before its entries are appended.

    Attributes:
        layer: the cache layer (its store, tokens seen, forwards so far).
        module: the model's attention module (``W_O`` for scorers that read it).
        query: ``(batch, q_heads, q, d)``, post-RoPE.
        keys, values: the new entries ``(batch, kv_heads, q, d)``, as the model wrote them.
        padding: the boolean padding mask ``(batch, ≥ seen + q)`` (True: a real token) covering every slot
            up to this call's end; None when every token is real.
        form: how logits become weights (scaling, soft-capping, sinks).
        sliding_window: the layer's window, None for a full-attention layer.
        layer_inputs: the attention-input hidden states ``(batch, q, hidden)`` when a scorer reads them.
    """

    layer: LayerState
    module: torch.nn.Module
    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    padding: torch.Tensor | None
    form: AttentionForm
    sliding_window: int | None
    layer_inputs: torch.Tensor | None

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    def blocks(self, size: int, seen: int) -> Iterator[LayerCall]:
        """The call cut into blocks of ``size`` queries (``blockwise``); ``seen``: tokens before the call.

        Each block's padding covers the slots up to the block's end. Blocks are made one at a time, so a
        block is cut only after the previous one went through every step.
        """
        for lo in range(0, self.q_len, size):
            hi = min(lo + size, self.q_len)
            yield LayerCall(
                self.layer,
                self.module,
                self.query[:, :, lo:hi],
                self.keys[:, :, lo:hi],
                self.values[:, :, lo:hi],
                None if self.padding is None else self.padding[:, : seen + hi],
                self.form,
                self.sliding_window,
                None if self.layer_inputs is None else self.layer_inputs[:, lo:hi],
            )
