"""Ragged per-(batch item, KV head) storage of one attention layer.

Every (batch item, KV head) pair owns a *segment* of flat key/value buffers. A segment that keeps
100 entries holds 100 entries (plus, during decoding, a small growth slack that is reported in
``nbytes``): heads with different budgets (AdaKV, DBTrimKV) really use different amounts of memory,
unlike masking schemes that keep a padded maximum.

:class:`LayerStore` is assembled from one module per concern, so each stays small:

* :mod:`kvsieve.cache.store_layout` — the buffers, the uniform and ragged segment layouts, the dense view
  (:mod:`kvsieve.cache.dense_view`) and byte counts;
* :mod:`kvsieve.cache.store_append` — appends, capacity growth with slack;
* :mod:`kvsieve.cache.store_compaction` — keeping chosen entries, batch selection, drops by position,
  in-place edits (merges, side-data updates);
* :mod:`kvsieve.cache.store_snapshot` — every held entry out and back in (saved contexts);
* :mod:`kvsieve.cache.store_tiers` — lower-precision tiers (packed, KIVI groups) and the combined view.

Side data (H2O's accumulated attention, merge counts, retention gates...) are per-entry buffers of any
trailing shape that move with their entries (:class:`SideSpec`). :class:`StoreHook` objects (e.g.
per-page key min/max, :mod:`kvsieve.cache.pages`) are told about every append and every compaction.
"""

from __future__ import annotations

import torch

from kvsieve.cache.dense_view import DenseView
from kvsieve.cache.side_data import SideSpec
from kvsieve.cache.store_append import GROWTH, StoreAppend
from kvsieve.cache.store_hook import StoreHook
from kvsieve.cache.store_snapshot import StoreSnapshot
from kvsieve.cache.store_tiers import StoreTiers

__all__ = ["GROWTH", "DenseView", "LayerStore", "SideSpec", "StoreHook"]


class LayerStore(StoreTiers, StoreAppend, StoreSnapshot):  # StoreTiers first: it wraps the others
    """Keys, values, absolute positions and per-entry side data of one layer, ragged per segment."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__(batch, heads, head_dim, dtype, device)
        self.side_specs: dict[str, SideSpec] = {}
        self.hooks: list[StoreHook] = []
        #: Most entries any segment has held at once (right after an append, before compaction).
        self.peak_length = 0
        #: Lower-precision tiers (:mod:`kvsieve.cache.store_tiers`); empty unless a policy quantizes.
        self.tiers = []
        self._combined = None
        self._derived = {}
        self._tier_units = None
        self._packed_tiers = None
        #: Side data that :meth:`write_rows` (a merge) or :meth:`restore` may have set away from its fill (host
        #: bookkeeping: a field not named here still holds its fill everywhere, e.g. every merge count is 1).
        self.written_sides: set[str] = set()

    def ensure_side(self, spec: SideSpec) -> None:
        """Create per-entry side data ``spec.name`` (filled with ``spec.fill``) if absent."""
        if spec.name in self.extras:
            return
        self.side_specs[spec.name] = spec
        self.extras[spec.name] = torch.full(
            (self.keys.shape[0], *spec.shape), spec.fill, dtype=spec.dtype, device=self.device
        )
        for tier in self.tiers:  # quantized entries keep their side data too
            tier.ensure_side(spec)
        self._combined = None
        self._dense_cache = None

    def ensure_extra(self, name: str, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        """Create scalar per-entry side data ``name`` if absent (shorthand of :meth:`ensure_side`)."""
        self.ensure_side(SideSpec(name, (), dtype, fill))

    def add_hook(self, hook: StoreHook) -> None:
        self.hooks.append(hook)
        hook.after_layout(self)

    def nbytes(self) -> int:
        """Bytes allocated for keys, values, positions, side data and hook data (growth slack included), and a
        padded layout's or strided runs' per-row validity, its additive mask and the one-call decoding mask, while
        they are kept."""
        total = self.keys.nbytes + self.values.nbytes + self.positions.nbytes
        total += sum(t.nbytes for t in (self._row_valid, self._row_bias) if t is not None)
        total += 0 if self._one_call_mask is None else self._one_call_mask[2].nbytes
        total += sum(t.nbytes for t in self._extras.values()) + sum(tier.nbytes() for tier in self.tiers)
        total += self.deferred_nbytes()
        return total + sum(hook.nbytes() for hook in self.hooks)
