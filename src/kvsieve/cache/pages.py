"""Per-page key statistics kept in step with a layer store (Quest, Tang et al. 2024, arXiv:2406.10774,
Sec. 3.2; the hybrid sparse attention of RocketKV (Behnam et al., 2025, arXiv:2502.14051), Sec. 3.4).

Each segment's held entries are split, in position order, into pages of ``page_size`` consecutive
entries; for every page the element-wise maximum and minimum of its keys are kept. Appends update only
the pages they touch (``scatter_reduce_`` with ``amax``/``amin``); a compaction or any other layout change
recomputes every page from the held keys, so the statistics always describe exactly what is held. With
quantized tiers the pages are those of the combined view (every entry in position order, quantized ones
dequantized), so a selector reads quantized entries as it reads full-precision ones.
Unused page slots hold ``-inf`` (max) / ``+inf`` (min). The statistics keep the keys' dtype: a max or
min of stored values is one of them, so nothing is rounded, and a page costs what ``2·d`` key elements
cost (RocketKV Table 1's accounting).
"""

from __future__ import annotations

import math

import torch

from kvsieve.cache.store import LayerStore, StoreHook

#: Page slots added per segment when an append needs a page that does not exist yet.
PAGE_GROWTH = 8


class PageMinMax(StoreHook):
    """Element-wise key max/min of every page of ``page_size`` held entries, per (batch item, KV head)."""

    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be an int ≥ 1; got {page_size!r}")
        self.page_size = page_size
        self.kmax = torch.empty(0)
        self.kmin = torch.empty(0)
        self.slots = 0  # page slots per segment

    # ------------------------------------------------------------------ reading
    def page_counts(self, store: LayerStore) -> torch.Tensor:
        """Pages per segment ``(segments,)`` (host tensor): ``ceil(length / page_size)``."""
        return (store.length + self.page_size - 1) // self.page_size

    def view(self, store: LayerStore) -> tuple[torch.Tensor, torch.Tensor]:
        """``(batch, heads, slots, d)`` max and min; slots past a segment's page count are ±inf."""
        shape = (store.batch, store.heads, self.slots, store.head_dim)
        return self.kmax.view(shape), self.kmin.view(shape)

    def nbytes(self) -> int:
        return self.kmax.nbytes + self.kmin.nbytes

    # ------------------------------------------------------------------ hooks
    def after_layout(self, store: LayerStore) -> None:
        view = store.dense()
        keys = view.keys
        b, h, length, d = keys.shape
        pages = max(math.ceil(length / self.page_size), 0)
        padded = pages * self.page_size
        valid = view.valid if view.valid is not None else torch.ones(b, h, length, dtype=torch.bool, device=keys.device)
        if padded > length:
            keys = torch.nn.functional.pad(keys, (0, 0, 0, padded - length))
            valid = torch.nn.functional.pad(valid, (0, padded - length), value=False)
        keys = keys.reshape(b, h, pages, self.page_size, d)
        valid = valid.reshape(b, h, pages, self.page_size, 1)
        kmax = keys.masked_fill(~valid, -math.inf).amax(dim=3) if pages else keys.new_empty(b, h, 0, d)
        kmin = keys.masked_fill(~valid, math.inf).amin(dim=3) if pages else keys.new_empty(b, h, 0, d)
        self.slots = pages + PAGE_GROWTH
        self.kmax = torch.full((b * h * self.slots, d), -math.inf, dtype=keys.dtype, device=keys.device)
        self.kmin = torch.full((b * h * self.slots, d), math.inf, dtype=keys.dtype, device=keys.device)
        self.kmax.view(b, h, self.slots, d)[:, :, :pages] = kmax
        self.kmin.view(b, h, self.slots, d)[:, :, :pages] = kmin

    def after_append(self, store: LayerStore, rows: torch.Tensor | None, count: int) -> None:
        if rows is None and count == 1 and not store.tiered:  # a uniform decoding step: one key at the same slot
            self._one_each_uniform(store)
            return
        device = store.keys.device
        length = store.length
        if rows is None:  # uniform: ``count`` new entries at the end of every segment
            segments = torch.arange(store.segments, device=device).repeat_interleave(count)
            local = (length.to(device) - count)[:, None] + torch.arange(count, device=device)[None, :]
            local = local.reshape(-1)
            flat_rows = (store.start.to(device)[:, None] + local.view(store.segments, count)).reshape(-1)
        else:
            flat_rows = rows
            segments = store.segments_of(rows)
            local = rows - store.start.to(device)[segments]
        local = store.dense_slots(local, segments)  # after the segment's quantized entries, if any
        page = local // self.page_size
        needed = int(page.max()) + 1 if page.numel() else 0
        if needed > self.slots:
            self._grow(store, needed + PAGE_GROWTH)
        flat_page = segments * self.slots + page
        keys = store.keys.index_select(0, flat_rows)
        index = flat_page[:, None].expand(-1, keys.shape[-1])
        self.kmax.scatter_reduce_(0, index, keys, "amax", include_self=True)
        self.kmin.scatter_reduce_(0, index, keys, "amin", include_self=True)

    def _one_each_uniform(self, store: LayerStore) -> None:
        """:meth:`after_append` of one key per segment at the end of a uniform store (a decoding step): every new key
        lies in the same page of its segment, known on the host, so its page's max and min take it in place (the
        same as ``scatter_reduce_``'s ``amax``/``amin`` with ``include_self``) — no index built from the host
        bookkeeping and no device read (on a GPU each was a host round trip per layer and step)."""
        slot = store.max_length - 1  # the new key's slot in every segment (Python int)
        page = slot // self.page_size
        if page + 1 > self.slots:
            self._grow(store, page + 1 + PAGE_GROWTH)
        keys = store.capacity_views()[0].select(2, slot)  # (batch, heads, d)
        kmax, kmin = self.view(store)
        page_max, page_min = kmax.select(2, page), kmin.select(2, page)
        torch.maximum(page_max, keys, out=page_max)
        torch.minimum(page_min, keys, out=page_min)

    def _grow(self, store: LayerStore, slots: int) -> None:
        b, h, d = store.batch, store.heads, store.head_dim
        kmax = torch.full((b * h * slots, d), -math.inf, dtype=store.keys.dtype, device=store.keys.device)
        kmin = torch.full((b * h * slots, d), math.inf, dtype=store.keys.dtype, device=store.keys.device)
        kmax.view(b, h, slots, d)[:, :, : self.slots] = self.kmax.view(b, h, self.slots, d)
        kmin.view(b, h, slots, d)[:, :, : self.slots] = self.kmin.view(b, h, self.slots, d)
        self.kmax, self.kmin, self.slots = kmax, kmin, slots
