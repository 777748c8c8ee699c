"""Store hooks: per-store data kept in step with the entries (page min/max, member pages, value sums, a
selector's state), told about every append and every compaction."""

from __future__ import annotations

import torch

from kvsieve.cache.store_layout import StoreLayout


class StoreHook:
    """Per-store data kept in step with the entries (subclass and register with :meth:`LayerStore.add_hook`).

    ``store`` is always a :class:`~kvsieve.cache.store.LayerStore`; it is typed by its base
    :class:`StoreLayout` (what a hook reads: layout, dense view, buffers) because ``LayerStore`` imports this
    module.
    """

    def after_append(self, store: StoreLayout, rows: torch.Tensor | None, count: int) -> None:
        """Entries were appended: ``rows`` are their flat row indices (None: ``count`` per segment, uniform)."""

    def after_layout(self, store: StoreLayout) -> None:
        """Entries were removed, reordered or moved (compaction, batch selection)."""

    def nbytes(self) -> int:
        """Bytes this hook holds (``KVCache.kv_nbytes()["aux"]``)."""
        return 0

    def traffic(self) -> tuple[int | torch.Tensor, int, int] | None:
        """KV traffic measured at decoding (bytes read, bytes full attention would read, steps); None: not measured."""
        return None
