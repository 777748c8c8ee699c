"""Ragged per-(batch item, KV head) storage of one attention layer.

Every (batch item, KV head) pair owns a *segment* of flat key/value buffers. A segment that keeps
100 entries holds 100 entries (plus, during decoding, a small growth slack that is reported in
``nbytes``): heads with different budgets (AdaKV, DBTrimKV) really use different amounts of memory,
unlike masking schemes that keep a padded maximum.

Layout: buffers of shape ``(total_capacity, *trailing)``; segment ``s = b * heads + h`` occupies rows
``[start[s], start[s] + capacity[s])`` and its first ``length[s]`` rows are valid, in increasing
position order. Two layouts share these buffers:

* **uniform** — every segment has the same length and capacity, back to back (``start = s·capacity``).
  The layout is described by two Python ints, ``dense()`` is a zero-copy ``(batch, heads, L, ...)``
  view and a decoding append is one slice copy per buffer: no index tensors, no host round trip.
  This is the state after a uniform compaction (SnapKV at a fixed budget) and during full-cache decoding.
* **ragged** — per-segment ``start``/``length``/``capacity`` (host ``long`` tensors: bookkeeping only,
  the entries stay on the input's device). ``dense()`` gathers into a padded view with a validity mask;
  the gather index is cached and rebuilt only when the layout changes or entries are appended.

Side data (H2O's accumulated attention, merge counts, retention gates...) are per-entry buffers of any
trailing shape that move with their entries. :class:`StoreHook` objects (e.g. per-page key min/max,
:mod:`kvsieve.cache.pages`) are told about every append and every compaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Entries added per segment whenever an append does not fit (amortised O(1) appends at decoding).
GROWTH = 64


class DenseView:
    """Padded ``(batch, heads, L, ...)`` view of a layer store; ``valid`` is None when nothing is padded.

    Keys and values are materialised at once; positions and side data only when read (a ragged decoding
    step that needs neither gathers two buffers, not all of them).
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor | None,
        valid: torch.Tensor | None,
        extras: dict[str, torch.Tensor] | None = None,
        fetch: Callable[[str], torch.Tensor] | None = None,
        side_names: tuple[str, ...] = (),
    ):
        self.keys, self.values, self.valid = keys, values, valid
        self._positions = positions
        self._extras = extras
        self._fetch = fetch
        self._side_names = side_names

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            assert self._fetch is not None
            self._positions = self._fetch("positions")
        return self._positions

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        if self._extras is None:
            assert self._fetch is not None
            self._extras = {name: self._fetch(name) for name in self._side_names}
        return self._extras


class StoreHook:
    """Per-store data kept in step with the entries (subclass and register with :meth:`LayerStore.add_hook`)."""

    def after_append(self, store: LayerStore, rows: torch.Tensor | None, count: int) -> None:
        """Entries were appended: ``rows`` are their flat row indices (None: ``count`` per segment, uniform)."""

    def after_layout(self, store: LayerStore) -> None:
        """Entries were removed, reordered or moved (compaction, batch selection)."""

    def nbytes(self) -> int:
        """Bytes this hook holds (``KVCache.kv_nbytes()["aux"]``)."""
        return 0

    def traffic(self) -> tuple[int | torch.Tensor, int, int] | None:
        """KV traffic measured at decoding (bytes read, bytes full attention would read, steps); None: not measured."""
        return None


@dataclass(frozen=True)
class SideSpec:
    """Per-entry side data a policy part keeps: ``name``, trailing ``shape``, ``dtype`` and the value of new entries."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    fill: float = 0.0


class LayerStore:
    """Keys, values, absolute positions and per-entry side data of one layer, ragged per segment."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.dtype, self.device = dtype, device
        self.keys = torch.empty((0, head_dim), dtype=dtype, device=device)
        self.values = torch.empty((0, head_dim), dtype=dtype, device=device)
        self.positions = torch.empty((0,), dtype=torch.long, device=device)
        self.extras: dict[str, torch.Tensor] = {}
        self.side_specs: dict[str, SideSpec] = {}
        self.hooks: list[StoreHook] = []
        # uniform layout: (length, capacity) per segment; None while ragged (then the tensors below hold it)
        self._uniform: tuple[int, int] | None = (0, 0)
        self._start = self._length = self._capacity = torch.zeros(0, dtype=torch.long)
        self._max_length = 0
        self._min_slack = 0
        self._dense_cache: DenseView | None = None
        self._gather_cache: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._next_rows: torch.Tensor | None = None
        #: Most entries any segment has held at once (right after an append, before compaction).
        self.peak_length = 0

    # ------------------------------------------------------------------ layout bookkeeping
    @property
    def segments(self) -> int:
        return self.batch * self.heads

    @property
    def is_uniform(self) -> bool:
        """All segments have equal length and capacity, back to back (zero-copy dense view)."""
        return self._uniform is not None

    @property
    def max_length(self) -> int:
        """Most entries any segment holds now (a Python int: no device or host tensor work)."""
        return self._uniform[0] if self._uniform is not None else self._max_length

    @property
    def start(self) -> torch.Tensor:
        if self._uniform is not None:
            return torch.arange(self.segments, dtype=torch.long) * self._uniform[1]
        return self._start

    @property
    def length(self) -> torch.Tensor:
        """Entries held per segment, host ``long`` tensor ``(segments,)``."""
        if self._uniform is not None:
            return torch.full((self.segments,), self._uniform[0], dtype=torch.long)
        return self._length

    @property
    def capacity(self) -> torch.Tensor:
        if self._uniform is not None:
            return torch.full((self.segments,), self._uniform[1], dtype=torch.long)
        return self._capacity

    def _set_ragged(self, start: torch.Tensor, length: torch.Tensor, capacity: torch.Tensor) -> None:
        """Adopt a per-segment layout; falls back to the uniform description whenever it is one."""
        self._dense_cache = None
        self._gather_cache = None
        self._next_rows = None
        segs = self.segments
        if segs == 0:
            self._uniform = (0, 0)
            return
        first_len, first_cap = int(length[0]), int(capacity[0])
        if (
            bool((length == first_len).all())
            and bool((capacity == first_cap).all())
            and bool((start == torch.arange(segs) * first_cap).all())
        ):
            self._uniform = (first_len, first_cap)
            return
        self._uniform = None
        self._start, self._length, self._capacity = start.clone(), length.clone(), capacity.clone()
        self._max_length = int(length.max())
        self._min_slack = int((capacity - length).min())

    def lengths(self) -> torch.Tensor:
        """Entries held per (batch item, KV head), shape ``(batch, heads)`` (host tensor)."""
        return self.length.view(self.batch, self.heads).clone()

    def total_entries(self) -> int:
        if self._uniform is not None:
            return self._uniform[0] * self.segments
        return int(self._length.sum())

    def nbytes(self) -> int:
        """Bytes allocated for keys, values, positions, side data and hook data (growth slack included)."""
        total = self.keys.nbytes + self.values.nbytes + self.positions.nbytes
        total += sum(t.nbytes for t in self.extras.values())
        return total + sum(hook.nbytes() for hook in self.hooks)

    def entry_nbytes(self) -> int:
        """Bytes one held entry costs: key, value, position and its side data."""
        per_entry = (self.keys.element_size() + self.values.element_size()) * self.head_dim
        per_entry += self.positions.element_size()
        return per_entry + sum(t[:1].nbytes if t.shape[0] else _row_nbytes(t) for t in self.extras.values())

    def used_nbytes(self) -> int:
        """Bytes of the entries actually held (growth slack excluded)."""
        return self.total_entries() * self.entry_nbytes()

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values actually held."""
        return self.total_entries() * (self.keys.element_size() + self.values.element_size()) * self.head_dim

    # ------------------------------------------------------------------ dense access
    def gather_index(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Flat row index ``(segments, L)`` (padding slots repeat the last valid row), validity, ``L``."""
        if self._gather_cache is not None and self._gather_cache[2] != self.max_length:
            self._gather_cache = None
        if self._gather_cache is None:
            max_len = self.max_length
            offs = torch.arange(max_len)
            length, start = self.length, self.start
            valid = offs[None, :] < length[:, None]
            last = (start + (length - 1).clamp(min=0))[:, None]
            index = torch.minimum(start[:, None] + offs[None, :], last)
            index = index.clamp(max=max(self.keys.shape[0] - 1, 0))
            self._gather_cache = (index.to(self.device), valid.to(self.device), max_len)
        return self._gather_cache

    def dense(self) -> DenseView:
        """Padded view ``(batch, heads, L, ...)`` of all entries; ``valid`` is None if nothing is padded."""
        if self._dense_cache is not None:
            return self._dense_cache
        b, h = self.batch, self.heads
        if self._uniform is not None:
            length, cap = self._uniform

            def view(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, h, cap, *t.shape[1:])[:, :, :length]

            out = DenseView(
                view(self.keys), view(self.values), view(self.positions), None,
                {name: view(t) for name, t in self.extras.items()},
            )
        else:
            index, valid, max_len = self.gather_index()
            flat = index.reshape(-1)

            def gather(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(0, flat).view(b, h, max_len, *t.shape[1:])

            def fetch(name: str) -> torch.Tensor:
                return gather(self.positions if name == "positions" else self.extras[name])

            out = DenseView(
                gather(self.keys), gather(self.values), None, valid.view(b, h, max_len),
                None, fetch, tuple(self.extras),
            )
        self._dense_cache = out
        return out

    def invalidate_view(self) -> None:
        """Forget the cached dense view (after side data or entries changed in place)."""
        self._dense_cache = None

    # ------------------------------------------------------------------ mutation
    def ensure_side(self, spec: SideSpec) -> None:
        """Create per-entry side data ``spec.name`` (filled with ``spec.fill``) if absent."""
        if spec.name in self.extras:
            return
        self.side_specs[spec.name] = spec
        self.extras[spec.name] = torch.full(
            (self.keys.shape[0], *spec.shape), spec.fill, dtype=spec.dtype, device=self.device
        )
        self._dense_cache = None

    def ensure_extra(self, name: str, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        """Create scalar per-entry side data ``name`` if absent (shorthand of :meth:`ensure_side`)."""
        self.ensure_side(SideSpec(name, (), dtype, fill))

    def add_hook(self, hook: StoreHook) -> None:
        self.hooks.append(hook)
        hook.after_layout(self)

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        first_position: int,
        token_valid: torch.Tensor | None,
    ) -> None:
        """Append new entries ``(batch, heads, q, d)`` at absolute positions ``first_position + [0, q)``.

        ``token_valid`` ``(batch, q)`` marks real tokens; padding tokens are not stored. Side data of
        new entries starts at its spec's ``fill``.
        """
        q = keys.shape[2]
        self._dense_cache = None
        if token_valid is None and self._uniform is not None:
            self._append_uniform(keys, values, first_position, q)
        else:
            self._append_ragged(keys, values, first_position, token_valid)
        self.peak_length = max(self.peak_length, self.max_length)

    def _append_uniform(self, keys: torch.Tensor, values: torch.Tensor, first_position: int, q: int) -> None:
        assert self._uniform is not None
        length, cap = self._uniform
        if length + q > cap:
            self._grow_uniform(length + q + GROWTH)
            length, cap = self._uniform
        b, h, d = self.batch, self.heads, self.head_dim
        self.keys.view(b, h, cap, d)[:, :, length : length + q].copy_(keys)
        self.values.view(b, h, cap, d)[:, :, length : length + q].copy_(values)
        pos = self.positions.view(b, h, cap)[:, :, length : length + q]
        if q == 1:
            pos.fill_(first_position)
        else:
            pos.copy_(torch.arange(first_position, first_position + q, device=self.device).expand(b, h, q))
        for name, t in self.extras.items():
            t.view(b, h, cap, *t.shape[1:])[:, :, length : length + q].fill_(self.side_specs[name].fill)
        self._uniform = (length + q, cap)
        if self.hooks:
            for hook in self.hooks:
                hook.after_append(self, None, q)

    def _grow_uniform(self, capacity: int) -> None:
        assert self._uniform is not None
        length, cap = self._uniform
        b, h = self.batch, self.heads

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((b * h * capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
            out.view(b, h, capacity, *t.shape[1:])[:, :, :length] = t.view(b, h, cap, *t.shape[1:])[:, :, :length]
            return out

        self.keys, self.values, self.positions = grow(self.keys), grow(self.values), grow(self.positions)
        self.extras = {name: grow(t) for name, t in self.extras.items()}
        self._uniform = (length, capacity)
        self._gather_cache = None

    def _append_one_each(self, keys: torch.Tensor, values: torch.Tensor, position: int) -> None:
        """Decoding on a ragged layout: one entry per segment, written in place; bookkeeping by increments."""
        segs = self.segments
        if self._next_rows is None:
            self._next_rows = (self._start + self._length).to(self.device)
        dst = self._next_rows
        self.keys.index_copy_(0, dst, keys.reshape(segs, self.head_dim).to(self.dtype))
        self.values.index_copy_(0, dst, values.reshape(segs, self.head_dim).to(self.dtype))
        self.positions.index_fill_(0, dst, position)
        for name, t in self.extras.items():
            t.index_fill_(0, dst, self.side_specs[name].fill)
        cached = self._gather_cache
        if cached is not None:  # extend the cached gather index by the new entries instead of rebuilding it
            index, valid, width = cached
            col = self._length.to(self.device)[:, None]
            if int(self._max_length) + 1 > width:
                index = torch.cat([index, index[:, -1:]], dim=1)
                valid = torch.cat([valid, torch.zeros_like(valid[:, -1:])], dim=1)
            index = index.scatter(1, col, dst[:, None])
            valid = valid.scatter(1, col, True)
            self._gather_cache = (index, valid, int(self._max_length) + 1)
        self._next_rows = dst + 1
        self._length += 1
        self._max_length += 1
        self._min_slack -= 1
        for hook in self.hooks:
            hook.after_append(self, dst, 1)

    def _append_ragged(
        self, keys: torch.Tensor, values: torch.Tensor, first_position: int, token_valid: torch.Tensor | None
    ) -> None:
        h, q = keys.shape[1], keys.shape[2]
        if token_valid is None and q == 1 and self._uniform is None and self._min_slack >= 1:
            self._append_one_each(keys, values, first_position)
            return
        segs = self.segments
        if token_valid is None:
            counts = torch.full((segs,), q, dtype=torch.long)
            grow_all = True
        else:
            counts = token_valid.sum(dim=1).cpu().repeat_interleave(h)
            grow_all = False
        length, capacity = self.length, self.capacity
        if (grow_all and self._uniform is None and q > self._min_slack) or (
            not grow_all and bool((length + counts > capacity).any())
        ):
            self._relayout(length + counts + GROWTH)
        start, length = self.start, self.length
        base = (start + length).to(self.device)
        positions = torch.arange(first_position, first_position + q, device=self.device)
        if token_valid is None:
            dst = (base[:, None] + torch.arange(q, device=self.device)[None, :]).reshape(-1)
            src_keys, src_values = keys.reshape(-1, self.head_dim), values.reshape(-1, self.head_dim)
            src_pos = positions.repeat(segs)
        else:
            valid = token_valid.to(self.device).repeat_interleave(h, dim=0)  # (segments, q)
            rank = valid.long().cumsum(dim=1) - 1
            dst = (base[:, None] + rank)[valid]
            src_keys = keys.reshape(segs, q, self.head_dim)[valid]
            src_values = values.reshape(segs, q, self.head_dim)[valid]
            src_pos = positions[None, :].expand(segs, q)[valid]
        self.keys.index_copy_(0, dst, src_keys.to(self.dtype))
        self.values.index_copy_(0, dst, src_values.to(self.dtype))
        self.positions.index_copy_(0, dst, src_pos)
        for name, t in self.extras.items():
            t.index_fill_(0, dst, self.side_specs[name].fill)
        self._set_ragged(self.start, length + counts, self.capacity)
        for hook in self.hooks:
            hook.after_append(self, dst, q)

    def _relayout(self, capacity: torch.Tensor) -> None:
        """Move every segment into fresh buffers with the given per-segment capacity."""
        length, start = self.length, self.start
        new_start = torch.cumsum(capacity, 0) - capacity
        total = int(capacity.sum())
        offs = torch.arange(int(length.max()) if self.segments else 0)
        mask = offs[None, :] < length[:, None]
        src = (start[:, None] + offs[None, :])[mask].to(self.device)
        dst = (new_start[:, None] + offs[None, :])[mask].to(self.device)

        def move(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((total, *t.shape[1:]), dtype=t.dtype, device=t.device)
            out.index_copy_(0, dst, t.index_select(0, src))
            return out

        self.keys, self.values, self.positions = move(self.keys), move(self.values), move(self.positions)
        self.extras = {name: move(t) for name, t in self.extras.items()}
        self._set_ragged(new_start, length, capacity)

    def keep(self, local_index: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Keep, per segment ``s``, the entries ``local_index[s, :counts[s]]`` (ascending) and free the rest.

        ``local_index`` is ``(segments, K)`` of indices into each segment; the kept entries are exact
        copies of the originals, in their original order. Capacity shrinks to exactly what is kept.
        Returns the flat source rows that were kept (before the move), for callers that merge.
        """
        counts = counts.to(torch.long).cpu().reshape(-1)
        width = local_index.shape[1]
        mask = torch.arange(width)[None, :] < counts[:, None]
        src = (self.start[:, None].to(local_index.device) + local_index)[mask.to(local_index.device)]
        new_start = torch.cumsum(counts, 0) - counts
        total = int(counts.sum())
        src = src.to(self.device)

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, src) if total else t[:0].clone()

        self.keys, self.values, self.positions = take(self.keys), take(self.values), take(self.positions)
        self.extras = {name: take(t) for name, t in self.extras.items()}
        self._set_ragged(new_start, counts, counts.clone())
        for hook in self.hooks:
            hook.after_layout(self)
        return src

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder / select batch items (beam search, batch filtering)."""
        index = index.cpu()
        segs = (index[:, None] * self.heads + torch.arange(self.heads)[None, :]).reshape(-1)
        lengths, starts = self.length[segs], self.start[segs]
        max_len = int(lengths.max()) if len(segs) else 0
        offs = torch.arange(max_len)
        mask = offs[None, :] < lengths[:, None]
        src = (starts[:, None] + offs[None, :])[mask].to(self.device)
        self.batch = len(index)
        new_start = torch.cumsum(lengths, 0) - lengths
        self.keys, self.values, self.positions = (
            self.keys.index_select(0, src), self.values.index_select(0, src), self.positions.index_select(0, src)
        )
        self.extras = {name: t.index_select(0, src) for name, t in self.extras.items()}
        self._set_ragged(new_start, lengths, lengths.clone())
        for hook in self.hooks:
            hook.after_layout(self)

    def entries(self) -> dict[str, torch.Tensor]:
        """Every held entry, compact and in order: ``lengths`` ``(segments,)``, ``keys``/``values``
        ``(Σ lengths, head_dim)``, ``positions`` and each side datum as ``side.<name>`` (for saving)."""
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
        self.peak_length = max(self.peak_length, self.max_length)
        for hook in self.hooks:
            hook.after_layout(self)

    def add_dense(self, name: str, values: torch.Tensor) -> None:
        """Add ``(batch, heads, L, ...)`` values (laid out like :meth:`dense`) into side data ``name``."""
        target = self.extras[name]
        self._dense_cache = None
        if self._uniform is not None:
            cap = self._uniform[1]
            view = target.view(self.batch, self.heads, cap, *target.shape[1:])
            view[:, :, : values.shape[2]] += values.to(target.dtype)
            return
        index, valid, _ = self.gather_index()
        flat_values = values.reshape(self.segments, -1, *target.shape[1:])
        target.index_add_(0, index[valid], flat_values[valid].to(target.dtype))

    def write_rows(self, rows: torch.Tensor, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                   extras: dict[str, torch.Tensor] | None = None) -> None:
        """Overwrite entries at flat ``rows`` in place (merges); positions and layout are unchanged."""
        self._dense_cache = None
        if keys is not None:
            self.keys.index_copy_(0, rows, keys.to(self.dtype))
        if values is not None:
            self.values.index_copy_(0, rows, values.to(self.dtype))
        for name, t in (extras or {}).items():
            self.extras[name].index_copy_(0, rows, t.to(self.extras[name].dtype))
        for hook in self.hooks:
            hook.after_layout(self)

    def keep_positions_before(self, limit: int) -> None:
        """Drop every entry at position ``limit`` or later (rollback of the last tokens)."""
        self._keep_where(lambda positions: positions < limit)

    def keep_positions_after(self, min_position: int) -> None:
        """Drop every entry whose position is below ``min_position`` (sliding-window layers)."""
        self._keep_where(lambda positions: positions >= min_position)

    def _keep_where(self, predicate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        view = self.dense()
        keep = predicate(view.positions)
        if view.valid is not None:
            keep = keep & view.valid
        counts = keep.sum(dim=-1).reshape(-1).cpu()
        if bool((counts == self.length).all()):
            return
        width = keep.shape[-1]
        order = torch.where(keep, torch.arange(width, device=keep.device), width)
        local = torch.sort(order.reshape(self.segments, width), dim=-1).values
        self.keep(local, counts)


def _row_nbytes(t: torch.Tensor) -> int:
    per = t.element_size()
    for size in t.shape[1:]:
        per *= size
    return per
