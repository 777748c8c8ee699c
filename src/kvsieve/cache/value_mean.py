"""Per-segment sum of the held values, kept in step with a layer store (SparQ's mean value ``v̄``,
Ribar et al. 2024, Alg. 1): the mean of ``N`` values costs one ``d``-vector read at decoding instead of
``N·d``. Appends add the new values; any layout change (compaction, batch reorder) recomputes the sums
from what is held.
"""

from __future__ import annotations

import torch

from kvsieve.cache.store import LayerStore, StoreHook


class ValueSum(StoreHook):
    """Float32 ``Σ_j v_j`` over each (batch item, KV head) segment's held entries."""

    def __init__(self) -> None:
        self.sums = torch.empty(0)

    def mean(self, store: LayerStore, lengths: torch.Tensor) -> torch.Tensor:
        """``(batch, heads, d)`` mean value; ``lengths`` ``(batch, heads)`` on the values' device."""
        sums = self.sums.view(store.batch, store.heads, store.head_dim)
        return sums / lengths.clamp(min=1).to(sums.dtype)[..., None]

    def nbytes(self) -> int:
        return self.sums.nbytes

    def after_layout(self, store: LayerStore) -> None:
        view = store.dense()
        values = view.values.float()
        if view.valid is not None:
            values = values.masked_fill(~view.valid[..., None], 0.0)
        self.sums = values.sum(dim=2).reshape(store.segments, store.head_dim)

    def after_append(self, store: LayerStore, rows: torch.Tensor | None, count: int) -> None:
        if rows is None:  # uniform: ``count`` new entries at the end of every segment
            length, cap = store.max_length, store.keys.shape[0] // store.segments
            values = store.values.view(store.segments, cap, store.head_dim)[:, length - count : length]
            self.sums = self.sums + values.float().sum(dim=1)
            return
        segments = store.segments_of(rows)
        self.sums = self.sums.index_add(0, segments, store.values.index_select(0, rows).float())
