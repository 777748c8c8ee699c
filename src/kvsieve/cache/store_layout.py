"""Where a layer store's entries sit: the segment layout, the dense view built from it, and byte counts.

Buffers have shape ``(total_capacity, *trailing)``; segment ``s = b * heads + h`` occupies rows
``[start[s], start[s] + capacity[s])`` and its first ``length[s]`` rows are valid, in increasing position
order. Two layouts share these buffers:

* **uniform** — every segment has the same length and capacity, back to back (``start = s·capacity``).
  The layout is described by two Python ints, ``dense()`` is a zero-copy ``(batch, heads, L, ...)``
  view and a decoding append is one slice copy per buffer: no index tensors, no host round trip.
  This is the state after a uniform compaction (SnapKV at a fixed budget) and during full-cache decoding.
* **ragged** — per-segment ``start``/``length``/``capacity`` (host ``long`` tensors: bookkeeping only,
  the entries stay on the input's device). ``dense()`` gathers into a padded view with a validity mask;
  the gather index is cached and rebuilt only when the layout changes or entries are appended.
  A ragged layout whose segments all have the same capacity, back to back (**padded**: a compaction chooses
  it when a decoding step would attend over one padded view anyway, see
  :meth:`~kvsieve.cache.store_compaction.StoreCompaction.keep`), has a zero-copy ``dense()`` instead: the
  buffers viewed ``(batch, heads, capacity, ...)`` up to the longest segment, with the validity mask; its free
  rows hold copies of held entries (finite, so a masked slot adds exact zeros to an attention output).
  A ragged layout may also be cut into **strided runs** (a compaction chooses them when a decoding step would attend
  by length group anyway, see :meth:`~kvsieve.cache.store_compaction.StoreCompaction.plan_runs`): each run's segments
  have the same capacity and lie back to back, so a decoding step attends over each run as a zero-copy view of the
  buffers with the run's validity, instead of gathering its entries. Segments then lie in run order, not in
  segment order (:meth:`StoreLayout.segments_of` maps rows back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvsieve.cache.deferred_side import DeferredSide
from kvsieve.cache.dense_view import DenseView
from kvsieve.cache.length_groups import LengthGroup, RunViews, call_cost, plan_groups
from kvsieve.native.merge_lowest import MergeBuffers

#: Keys, values and positions of a uniform layout viewed ``(batch, heads, capacity, ...)``.
CapacityViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class LayoutListener(Protocol):
    """What a store tells of its layout changes (:class:`~kvsieve.cache.store_hook.StoreHook` is one)."""

    def after_layout(self, store: StoreLayout) -> None: ...


class StoreLayout:
    """The base of :class:`~kvsieve.cache.store.LayerStore`: its buffers, their segment layout and views.

    Appending (:mod:`kvsieve.cache.store_append`), compaction (:mod:`kvsieve.cache.store_compaction`) and
    saving (:mod:`kvsieve.cache.store_snapshot`) change the buffers and adopt a new layout with
    :meth:`_set_ragged`.
    """

    hooks: Sequence[LayoutListener]
    #: A ragged layout's lengths as last brought up to date, and the decoding appends since (:attr:`_length`).
    _held: torch.Tensor
    _decoded: int = 0
    #: Set while an operation moves entries in several steps (the tiers' keep, batch selection, restore):
    #: hooks are told once, at its end, when the dense view they rebuild from is whole again.
    _hooks_deferred: bool = False
    #: Whether the last append gave every segment one entry at its end (a decoding step), so side data of its
    #: entries may be deferred (:meth:`~kvsieve.cache.store_append.StoreAppend.defer_to_appended`).
    _one_each_appended: bool = False
    #: Decoding appends of one entry per segment so far (where deferred side data lies: :meth:`settle_deferred`).
    _one_each_appends: int = 0

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.dtype, self.device = dtype, device
        self.keys = torch.empty((0, head_dim), dtype=dtype, device=device)
        self.values = torch.empty((0, head_dim), dtype=dtype, device=device)
        self.positions = torch.empty((0,), dtype=torch.long, device=device)
        self._extras: dict[str, torch.Tensor] = {}
        #: Side data of decoding entries computed when first read (:mod:`kvsieve.cache.deferred_side`), by field.
        self._deferred: dict[str, DeferredSide] = {}
        # uniform layout: (length, capacity) per segment; None while ragged (then the tensors below hold it)
        self._uniform: tuple[int, int] | None = (0, 0)
        self._start = self._length = self._capacity = torch.zeros(0, dtype=torch.long)
        self._max_length = 0
        self._min_slack = 0
        #: The common capacity of a padded ragged layout (equal capacities, back to back); None otherwise.
        self._stride: int | None = None
        #: Per buffer row, whether it holds an entry, on the entries' device (built for a padded layout's view and
        #: strided runs; decoding appends set the rows they write in place): :meth:`row_valid`.
        self._row_valid: torch.Tensor | None = None
        #: The same as an additive mask in the entries' dtype (0 where a row holds an entry, −inf elsewhere), built
        #: when a decoding step first masks with it and kept by decoding appends: SDPA then adds it as it is, where a
        #: boolean mask is converted to this at every call (:meth:`row_bias`).
        self._row_bias: torch.Tensor | None = None
        #: A ragged layout's strided runs: the segments of each, in buffer order (None: segment order, no runs).
        self._runs: tuple[tuple[int, ...], ...] | None = None
        #: Segment ends in buffer order and the order (None when it is segment order), on the entries' device.
        self._segment_lookup: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._dense_cache: DenseView | None = None
        self._gather_cache: tuple[torch.Tensor, torch.Tensor, int] | None = None
        #: A ragged layout's next rows, one ``(segments,)`` view per decoding step ahead, and the next step's index.
        self._next_rows: tuple[torch.Tensor, ...] | None = None
        self._next_step = 0
        #: The position the table's first step was written for (positions of consecutive steps are written ahead).
        self._table_position = 0
        #: Per segment, the slot a decoding step writes next, on the entries' device (no host copy per step).
        self._next_cols: torch.Tensor | None = None
        #: Where the last append wrote (see :meth:`~kvsieve.cache.store_append.StoreAppend.add_to_appended`):
        #: ``(first slot, q)`` of a uniform append, or flat rows ``(segments, q)`` with their validity.
        self._appended: tuple[int, int] | tuple[torch.Tensor, torch.Tensor | None] | None = None
        #: The length groups of the current ragged layout and the longest segment when they were planned.
        self._groups: tuple[list[LengthGroup] | None, int] | None = None
        #: The uniform buffers viewed ``(batch, heads, capacity, ...)``, with the buffers and capacity they view.
        self._capacity_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, CapacityViews] | None = None
        #: Views of the next decoding slots of those (``StoreAppend._slot_views``): the capacity views they come from,
        #: the first slot, and per buffer one view per slot (None: one append made none yet).
        self._slot_cache: tuple[CapacityViews, int, tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None,
                                tuple[torch.Tensor, ...] | None] | None = None
        #: Views of the next decoding slots of the side-data buffers (``StoreAppend._side_slot_views``): the capacity
        #: and the buffers they view, the first slot, and per slot each buffer's view with its fill (None: none yet).
        self._side_slot_cache: tuple[int, tuple[torch.Tensor, ...], int,
                                     tuple[tuple[tuple[torch.Tensor, float], ...], ...] | None] | None = None
        self._merge_buffers: MergeBuffers | None = None  # the EMS pass's checked view (store_compaction)
        #: The strided runs' views (:meth:`run_views`) with the buffers and validity bias they view.
        self._run_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor, RunViews] | None = None
        #: Which rows each query row of a one-call decoding step sees, as an additive mask (:meth:`one_call_mask`),
        #: with the buffers it covers and the query rows per segment it was built for.
        self._one_call_mask: tuple[torch.Tensor, int, torch.Tensor] | None = None
        #: A ragged layout's entries per batch row (:meth:`row_totals`), kept by decoding appends.
        self._row_totals: list[int] | None = None
        #: Per decoding step ahead (:attr:`_next_rows`), the flat cells of that mask the step's rows open.
        self._mask_cells: tuple[torch.Tensor, ...] | None = None
        #: A padded layout's buffers and bias viewed ``(batch, heads, capacity, ...)`` (:meth:`padded_decoding_views`),
        #: with the tensors they view.
        self._padded_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, CapacityViews] | None = None

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        """Per-entry side data by name, each flat like the buffers (rows × shape); pending deferred values are
        computed and written first (:meth:`settle_deferred`), so whatever reads or moves side data sees it whole."""
        if self._deferred:
            self.settle_deferred()
        return self._extras

    @extras.setter
    def extras(self, value: dict[str, torch.Tensor]) -> None:
        self._extras = value

    @property
    def holds_side(self) -> bool:
        """Whether the store holds any side-data field (unlike :attr:`extras`, nothing deferred is settled)."""
        return bool(self._extras)

    def side_names(self) -> tuple[str, ...]:
        """The side-data fields this store holds (nothing is computed: pending deferred values stay pending)."""
        return tuple(self._extras)

    def settle_deferred(self) -> None:
        """Compute every deferred side-data update (:mod:`kvsieve.cache.deferred_side`) and add it to its entries:
        each input's entries are each segment's newest but as many as decoding appends came after them. Every change
        of the store other than a decoding append settles first."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, {}
        for name, side in deferred.items():
            target = self._extras[name]
            values = side.values().to(target.dtype)  # (batch, heads, k, ...), the inputs' order
            back = torch.tensor([self._one_each_appends - count for count in side.appends])  # 0: the newest entry
            if self._uniform is not None:
                length, cap = self._uniform
                view = target.view(self.batch, self.heads, cap, *target.shape[1:])
                view.index_add_(2, (length - 1 - back).to(self.device), values)
            else:
                last = self._start + self._length - 1  # host: each segment's newest entry
                rows = (last[:, None] - back[None, :]).reshape(-1).to(self.device)
                target.index_add_(0, rows, values.reshape(-1, *target.shape[1:]))
        self._dense_cache = None

    def deferred_nbytes(self) -> int:
        """Bytes the pending deferred inputs hold."""
        return sum(side.nbytes() for side in self._deferred.values())

    def _layout_changed(self) -> None:
        """Tell every hook that entries were removed, moved or reordered (not while deferred)."""
        if not self._hooks_deferred:
            for hook in self.hooks:
                hook.after_layout(self)

    # ------------------------------------------------------------------ layout bookkeeping
    @property
    def segments(self) -> int:
        return self.batch * self.heads

    @property
    def is_uniform(self) -> bool:
        """All segments have equal length and capacity, back to back (zero-copy dense view)."""
        return self._uniform is not None

    @property
    def is_padded(self) -> bool:
        """Ragged lengths in equal capacities, back to back: :meth:`dense` is a zero-copy view (module docstring)."""
        return self._stride is not None

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
    def _length(self) -> torch.Tensor:
        """Entries held per segment of a ragged layout (host ``long``). A decoding append adds one to every segment:
        it counts that in ``_decoded`` (a Python int) and the tensor is brought up to date when next read, so a
        decoding step makes no host tensor operation per layer for it."""
        if self._decoded:
            self._held = self._held + self._decoded
            self._decoded = 0
        return self._held

    @_length.setter
    def _length(self, value: torch.Tensor) -> None:
        self._held, self._decoded = value, 0

    def segment_rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A ragged layout's first row and held entries per segment (host ``long`` tensors, the lengths as last
        brought up to date) and the decoding appends since (each added one entry to every segment): where each
        segment's entries lie, read with no tensor operation (:mod:`kvsieve.native.segment_attention`)."""
        assert self._uniform is None, "a uniform layout has no per-segment rows"
        return self._start, self._held, self._decoded

    @property
    def capacity(self) -> torch.Tensor:
        if self._uniform is not None:
            return torch.full((self.segments,), self._uniform[1], dtype=torch.long)
        return self._capacity

    def _forget_layout(self) -> None:
        """Drop everything derived from the old layout and buffers."""
        self._dense_cache = None
        self._gather_cache = None
        self._next_rows = self._next_cols = None
        self._appended = None
        self._groups = None
        # they hold the buffers they view: a replaced one must be freed
        self._capacity_cache = self._slot_cache = self._side_slot_cache = None
        self._merge_buffers = None  # likewise
        self._run_views = None  # likewise
        self._padded_cache = None  # likewise
        self._one_call_mask = None
        self._mask_cells = None
        self._row_totals = None
        self._row_valid = None
        self._row_bias = None
        self._segment_lookup = None

    def _set_uniform(self, length: int, capacity: int) -> None:
        """Adopt a uniform layout of ``length`` entries in ``capacity`` rows per segment, back to back."""
        self._forget_layout()
        self._uniform = (length, capacity)
        self._stride = None
        self._runs = None

    def _set_ragged(self, start: torch.Tensor, length: torch.Tensor, capacity: torch.Tensor,
                    runs: tuple[tuple[int, ...], ...] | None = None) -> None:
        """Adopt a per-segment layout; falls back to the uniform description whenever it is one. ``runs``: the
        segments of each strided run (module docstring), kept only if each run's segments do lie back to back with
        one capacity."""
        self._forget_layout()
        segs = self.segments
        self._stride = None
        self._runs = None
        if segs == 0:
            self._uniform = (0, 0)
            return
        first_len, first_cap = int(length[0]), int(capacity[0])
        strided = bool((capacity == first_cap).all()) and bool((start == torch.arange(segs) * first_cap).all())
        if strided and bool((length == first_len).all()):
            self._uniform = (first_len, first_cap)
            return
        self._uniform = None
        self._stride = first_cap if strided else None
        self._start, self._length, self._capacity = start.clone(), length.clone(), capacity.clone()
        self._max_length = int(length.max())
        self._min_slack = int((capacity - length).min())
        if runs is not None and self._stride is None and _strided_runs(self._start, self._capacity, runs, segs):
            self._runs = runs
            self._groups = (self._run_groups(runs), self._max_length)

    def _run_groups(self, runs: tuple[tuple[int, ...], ...]) -> list[LengthGroup]:
        """The strided runs as the length groups a decoding step attends (each a zero-copy view)."""
        groups = []
        for members in runs:
            index = torch.tensor(members, dtype=torch.long)
            lengths = self._length[index]
            groups.append(LengthGroup(index, index.to(self.device), int(lengths.max()),
                                      int(lengths.min()) == int(lengths.max()), members,
                                      int(self._start[members[0]]), int(self._capacity[members[0]])))
        return groups

    def run_views(self) -> RunViews:
        """The strided runs' zero-copy views and the segment order a decoding step reads them in (a layout cut into
        runs only). Built once per layout and buffers: a step then narrows each view to its run's width instead of
        viewing the buffers anew, and reorders the queries and outputs with one index each (none when the runs lie
        in segment order) instead of one per run."""
        assert self._runs is not None and self._groups is not None and self._groups[0] is not None
        row_bias = self.row_bias()
        cached = self._run_views
        if cached is not None and cached[0] is self.keys and cached[1] is self.values and cached[2] is row_bias:
            return cached[3]
        groups, dim = self._groups[0], self.head_dim
        members = [segment for group in groups for segment in group.members]
        assert sorted(members) == list(range(self.segments)), "strided runs must hold every segment once"
        in_order = members == list(range(self.segments))
        order = torch.tensor(members, dtype=torch.long)
        keys, values, bias = [], [], []
        for group in groups:
            count, stride = len(group.members), group.stride
            rows = count * stride
            keys.append(self.keys.narrow(0, group.base or 0, rows).view(count, 1, stride, dim))
            values.append(self.values.narrow(0, group.base or 0, rows).view(count, 1, stride, dim))
            bias.append(None if group.equal else row_bias.narrow(0, group.base or 0, rows).view(count, 1, 1, stride))
        views = RunViews(
            None if in_order else order.to(self.device), None if in_order else torch.argsort(order).to(self.device),
            tuple(len(group.members) for group in groups), tuple(keys), tuple(values), tuple(bias),
        )
        self._run_views = (self.keys, self.values, row_bias, views)
        return views

    @property
    def runs(self) -> tuple[tuple[int, ...], ...] | None:
        """The strided runs' segments in buffer order (module docstring), or None."""
        return self._runs

    def row_valid(self) -> torch.Tensor:
        """Whether each buffer row holds an entry, ``(rows,)`` bool on the entries' device; built once per layout
        (from the host bookkeeping, one copy to the device) and kept true by decoding appends — once a decoding step
        masks with :meth:`row_bias`, appends keep that one only and this is derived from it when next asked."""
        if self._row_valid is None and self._row_bias is not None:  # decoding appends keep the bias only
            self._row_valid = self._row_bias == 0
        if self._row_valid is None:
            rows = self.keys.shape[0]
            length, start = self.length, self.start
            offs = torch.arange(int(length.max()) if length.numel() else 0)
            held = (start[:, None] + offs[None, :])[offs[None, :] < length[:, None]]
            valid = torch.zeros(rows, dtype=torch.bool)
            valid[held] = True
            self._row_valid = valid.to(self.device)
        return self._row_valid

    def row_bias(self) -> torch.Tensor:
        """:meth:`row_valid` as an additive attention mask ``(rows,)`` in the entries' dtype: 0 where a row holds an
        entry, −inf elsewhere (what SDPA makes of a boolean mask at every call; this one is built once per layout and
        kept by decoding appends, in place of the boolean one)."""
        if self._row_bias is None:
            valid = self.row_valid()
            bias = torch.zeros(valid.shape, dtype=self.dtype, device=valid.device)
            self._row_bias = bias.masked_fill_(~valid, float("-inf"))
        return self._row_bias

    def one_call_mask(self, per_head: int) -> torch.Tensor:
        """An additive mask ``(segments · per_head, rows)`` over the whole buffer, in the entries' dtype: row
        ``s · per_head + j`` (query row ``j`` of segment ``s``) is 0 where a buffer row holds an entry of segment ``s``
        and −inf elsewhere (slack, and every other segment's rows). It masks one call over the whole buffer to each
        query row's own held entries (strided runs at batch 1: ``grouped_decode``). Built once per layout and buffers
        (from the host bookkeeping, one copy to the device) and kept by decoding appends, which open each segment's
        new row in place: a step then masks with it as it is. While it is kept, appends keep no other validity than
        an additive one a decoding step already asked for (:meth:`row_bias`)."""
        cached = self._one_call_mask
        if cached is not None and cached[0] is self.keys and cached[1] == per_head:
            return cached[2]
        rows = torch.arange(self.keys.shape[0])
        start, length = self.start, self.length
        held = (rows[None, :] >= start[:, None]) & (rows[None, :] < (start + length)[:, None])  # (segments, rows)
        mask = torch.zeros(held.shape, dtype=self.dtype).masked_fill_(~held, float("-inf"))
        mask = mask.repeat_interleave(per_head, dim=0).to(self.device)
        self._one_call_mask = (self.keys, per_head, mask)
        self._mask_cells = None
        if self._row_bias is None:
            self._row_valid = None  # derived from the host bookkeeping again when next asked; appends skip it
        return mask

    def _mask_cells_ahead(self) -> tuple[torch.Tensor, ...]:
        """For each decoding step ahead (:attr:`_next_rows`), the flat cells of :meth:`one_call_mask` its rows open:
        row ``r`` of segment ``s`` for the segment's query rows ``s · per_head + j``. Made once per table of steps
        (one view per step), so an append opens its rows with one ``index_fill``."""
        if self._mask_cells is None:
            assert self._one_call_mask is not None and self._next_rows is not None
            _, per_head, mask = self._one_call_mask
            table = torch.stack(self._next_rows)  # (steps, segments)
            query_rows = torch.arange(mask.shape[0], device=table.device) * mask.shape[1]
            self._mask_cells = (query_rows[None, :] + table.repeat_interleave(per_head, dim=1)).unbind(0)
        return self._mask_cells

    def padded_decoding_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A padded layout's keys and values ``(batch, heads, L, d)`` and :meth:`row_bias` ``(batch, heads, L)`` up to
        the longest segment (``L``), what :meth:`dense` views, from views of the buffers made once per layout and
        buffers: a decoding step narrows three views instead of building the dense view."""
        assert self._stride is not None
        bias = self.row_bias()
        cached = self._padded_cache
        if cached is None or cached[0] is not self.keys or cached[1] is not self.values or cached[2] is not bias:
            shape = (self.batch, self.heads, self._stride)
            views = (self.keys.view(*shape, self.head_dim), self.values.view(*shape, self.head_dim), bias.view(shape))
            cached = self._padded_cache = (self.keys, self.values, bias, views)
        keys, values, mask = cached[3]
        held = self._max_length
        return keys.narrow(2, 0, held), values.narrow(2, 0, held), mask.narrow(2, 0, held)

    def segments_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The segment of each flat buffer row in ``rows`` (a device tensor), whatever order the segments lie in."""
        if self._segment_lookup is None:
            start, capacity = self.start, self.capacity
            # buffer order; a segment with no rows sorts before the one starting where it does (ends stay sorted)
            order = torch.argsort(start * 2 + (capacity > 0).long(), stable=True)
            ends = (start + capacity)[order]
            in_order = bool((order == torch.arange(order.numel())).all())
            self._segment_lookup = (ends.to(self.device), None if in_order else order.to(self.device))
        ends, order = self._segment_lookup
        found = torch.searchsorted(ends, rows, right=True)
        return found if order is None else order[found]

    def lengths(self) -> torch.Tensor:
        """Entries held per (batch item, KV head), shape ``(batch, heads)`` (host tensor)."""
        return self.length.view(self.batch, self.heads).clone()

    def row_totals(self) -> list[int]:
        """Entries held per batch row, every head counted, as Python ints (what a global budget compares with its
        limit at every decoding step: no tensor operation then). A ragged layout's are computed once per layout and
        kept by decoding appends."""
        if self._uniform is not None:
            return [self._uniform[0] * self.heads] * self.batch
        if self._row_totals is None:
            self._row_totals = [int(total) for total in self._length.view(self.batch, self.heads).sum(dim=1).tolist()]
        return self._row_totals

    def total_entries(self) -> int:
        if self._uniform is not None:
            return self._uniform[0] * self.segments
        return int(self._length.sum())

    def entry_nbytes(self) -> int:
        """Bytes one held entry costs: key, value, position and its side data."""
        per_entry = (self.keys.element_size() + self.values.element_size()) * self.head_dim
        per_entry += self.positions.element_size()
        return per_entry + sum(t[:1].nbytes if t.shape[0] else _row_nbytes(t) for t in self._extras.values())

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

    def length_groups(self) -> list[tuple[LengthGroup, int]] | None:
        """The segments in length groups with each group's padded width now (:mod:`kvsieve.cache.length_groups`),
        or None when one padded view is as good (uniform layouts included). Planned once per layout: decoding
        appends grow every segment by one, so each width grows with the longest segment."""
        if self._uniform is not None:
            return None
        if self._groups is None:
            runs = plan_groups(self._length, call_cost(self.device))
            groups = None if runs is None else [
                LengthGroup(members, members.to(self.device), longest, equal, tuple(members.tolist()))
                for members, longest, equal in runs
            ]
            self._groups = (groups, self._max_length)
        groups, planned_max = self._groups
        if groups is None:
            return None
        grown = self._max_length - planned_max
        return [(group, group.longest + grown) for group in groups]

    def capacity_views(self) -> CapacityViews:
        """Keys, values and positions of the uniform layout viewed ``(batch, heads, capacity, ...)``.

        Cached while the same buffers and capacity stay (a decoding step appends and attends through these
        views instead of re-viewing the buffers twice: two view and slice calls per buffer and step were a
        third of the engine's cost per layer on a small model)."""
        assert self._uniform is not None
        cap = self._uniform[1]
        cached = self._capacity_cache
        if (cached is not None and cached[0] is self.keys and cached[1] is self.values and cached[2] is self.positions
                and cached[3] == cap):
            return cached[4]
        b, h, d = self.batch, self.heads, self.head_dim
        views = (self.keys.view(b, h, cap, d), self.values.view(b, h, cap, d), self.positions.view(b, h, cap))
        self._capacity_cache = (self.keys, self.values, self.positions, cap, views)
        return views

    def side_capacity_view(self, name: str) -> torch.Tensor:
        """Side data ``name`` of the uniform layout viewed ``(batch, heads, capacity, ...)`` (not cached: side data
        is read when a scorer asks, not at every step)."""
        assert self._uniform is not None
        t = self.extras[name]
        return t.view(self.batch, self.heads, self._uniform[1], *t.shape[1:])

    def held_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform layout's held keys and values ``(batch, heads, L, d)``: zero-copy views, no positions or side
        data (what a decoding step that only attends needs)."""
        assert self._uniform is not None
        keys, values, _ = self.capacity_views()
        length = self._uniform[0]
        return keys.narrow(2, 0, length), values.narrow(2, 0, length)

    def dense(self) -> DenseView:
        """Padded view ``(batch, heads, L, ...)`` of all entries; ``valid`` is None if nothing is padded."""
        if self._dense_cache is not None:
            return self._dense_cache
        b, h = self.batch, self.heads
        if self._uniform is not None:
            length = self._uniform[0]
            keys, values, positions = self.capacity_views()

            def view(name: str) -> torch.Tensor:
                return (positions if name == "positions" else self.side_capacity_view(name)).narrow(2, 0, length)

            out = DenseView(keys.narrow(2, 0, length), values.narrow(2, 0, length), None, None, None, view,
                            tuple(self.extras))
        elif self._stride is not None:
            stride, max_len = self._stride, self._max_length
            valid = self.row_valid().view(self.segments, stride).narrow(1, 0, max_len)

            def narrow(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, h, stride, *t.shape[1:]).narrow(2, 0, max_len)

            def padded(name: str) -> torch.Tensor:
                return narrow(self.positions if name == "positions" else self.extras[name])

            out = DenseView(narrow(self.keys), narrow(self.values), None, valid.view(b, h, max_len), None, padded,
                            tuple(self.extras))
        else:
            index, valid, max_len = self.gather_index()
            flat = index.reshape(-1)

            def gather(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(0, flat).view(b, h, max_len, *t.shape[1:])

            buffers = {"keys": self.keys, "values": self.values, "positions": self.positions}

            def fetch(name: str) -> torch.Tensor:
                buffer = buffers.get(name)
                return gather(self.extras[name] if buffer is None else buffer)

            # every field gathered when first read: a plan that reads side data and positions only gathers no keys
            out = DenseView(None, None, None, valid.view(b, h, max_len), None, fetch, tuple(self.extras), max_len)
        self._dense_cache = out
        return out

    def invalidate_view(self) -> None:
        """Forget the cached dense view (after side data or entries changed in place)."""
        self._dense_cache = None

    def view_nbytes(self) -> int:
        """Bytes of cached views that copy entries (a ragged layout's gathered dense view; a uniform or padded
        one's views share the buffers and count 0): memory beyond :meth:`nbytes` while they live, 0 between
        engine steps."""
        view = self._dense_cache
        if view is None or self._uniform is not None or self._stride is not None:
            return 0
        return sum(t.nbytes for t in view.built())  # what it gathered so far (nothing is gathered to count it)

    def release_views(self) -> None:
        """Drop the views built for one layer step (the engine calls it when the step ends). A ragged layout's
        dense view is a gathered copy of every held entry: kept between steps it would hold the layer's entries
        twice until the next append invalidates it, and the next step rebuilds it anyway."""
        self._dense_cache = None


def _strided_runs(start: torch.Tensor, capacity: torch.Tensor, runs: tuple[tuple[int, ...], ...], segs: int) -> bool:
    """Whether ``runs`` cover every segment once and each run's segments lie back to back with one capacity."""
    if sorted(m for members in runs for m in members) != list(range(segs)):
        return False
    for members in runs:
        index = torch.tensor(members, dtype=torch.long)
        stride = int(capacity[members[0]])
        expected = int(start[members[0]]) + stride * torch.arange(len(members))
        if not (bool((capacity[index] == stride).all()) and torch.equal(start[index], expected)):
            return False
    return True


def _row_nbytes(t: torch.Tensor) -> int:
    per = t.element_size()
    for size in t.shape[1:]:
        per *= size
    return per


def run_capacities(capacity: torch.Tensor, runs: tuple[tuple[int, ...], ...] | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-segment ``capacity`` raised to each strided run's largest, and the segments in buffer order (None: no
    runs, segment order)."""
    if runs is None:
        return capacity, None
    capacity = capacity.clone()
    for members in runs:
        index = torch.tensor(members, dtype=torch.long)
        capacity[index] = int(capacity[index].max())
    return capacity, torch.tensor([m for members in runs for m in members], dtype=torch.long)


def ordered_starts(capacity: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Each segment's first row when segments of ``capacity`` rows lie back to back in ``order`` (None: segment
    order)."""
    if order is None:
        return torch.cumsum(capacity, 0) - capacity
    in_order = capacity[order]
    start = torch.empty_like(capacity)
    start[order] = torch.cumsum(in_order, 0) - in_order
    return start
