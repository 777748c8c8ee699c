"""Saving and restoring a layer store: every held entry, compact and in order (saved contexts)."""

from __future__ import annotations

import torch

from kvsieve.cache.store_hook import StoreHook
from kvsieve.cache.store_layout import StoreLayout


class StoreSnapshot(StoreLayout):
    """The save/restore part of :class:`~kvsieve.cache.store.LayerStore`."""

    written_sides: set[str]
    hooks: list[StoreHook]
    peak_length: int

    def entries(self) -> dict[str, torch.Tensor]:
        """Every held entry, compact and in order: ``lengths`` ``(segments,)``, ``keys``/``values``
        ``(Σ lengths, head_dim)``, ``positions`` and each side datum as ``side.<name>`` (for saving)."""
        self.settle_deferred()
        lengths, starts = self.length, self.start
        offs = torch.arange(self.max_length)
        src = (starts[:, None] + offs[None, :])[offs[None, :] < lengths[:, None]].to(self.device)
        out = {"lengths": lengths.clone(), "keys": self.keys.index_select(0, src),
               "values": self.values.index_select(0, src), "positions": self.positions.index_select(0, src)}
        out.update({f"side.{name}": t.index_select(0, src) for name, t in self.extras.items()})
        return out

    def restore(self, entries: dict[str, torch.Tensor]) -> None:
        """Hold exactly ``entries`` (as :meth:`entries` returns them); hooks rebuild their data from them.

        Raises ``ValueError`` naming what does not fit this store (segments, head size, side data).
        """
        self.settle_deferred()
        lengths = entries["lengths"].to(torch.long).cpu().reshape(-1)
        total = int(lengths.sum())
        if lengths.numel() != self.segments or bool((lengths < 0).any()):
            raise ValueError(f"entries: {lengths.numel()} segments for a store of {self.segments}")
        for name in ("keys", "values"):
            if tuple(entries[name].shape) != (total, self.head_dim):
                raise ValueError(f"entries: {name} {tuple(entries[name].shape)}, expected {(total, self.head_dim)}")
        if tuple(entries["positions"].shape) != (total,):
            raise ValueError(f"entries: positions {tuple(entries['positions'].shape)}, expected {(total,)}")
        missing = sorted(name for name in self.extras if f"side.{name}" not in entries)
        if missing:
            raise ValueError(f"entries: no side data {missing} (saved by a policy that keeps other side data)")
        self.keys = entries["keys"].to(device=self.device, dtype=self.dtype).contiguous()
        self.values = entries["values"].to(device=self.device, dtype=self.dtype).contiguous()
        self.positions = entries["positions"].to(device=self.device, dtype=torch.long).contiguous()
        self.extras = {name: entries[f"side.{name}"].to(device=self.device, dtype=t.dtype).contiguous()
                       for name, t in self.extras.items()}
        self._set_ragged(torch.cumsum(lengths, 0) - lengths, lengths, lengths.clone())
        self.written_sides = set(self.extras)  # saved side data may be anything
        self.peak_length = max(self.peak_length, self.max_length)
        self._layout_changed()
