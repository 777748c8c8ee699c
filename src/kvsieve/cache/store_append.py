"""Appending to a layer store: new entries at the end of their segments, growing capacity with slack.

A uniform store appends one slice per buffer; a ragged one writes each segment's new (non-padding)
entries at its end, in place while the slack lasts (decoding: one row per segment, bookkeeping by
increments), after moving every segment into larger buffers otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvsieve.cache.deferred_side import DeferredSide
from kvsieve.cache.side_data import SideSpec
from kvsieve.cache.store_hook import StoreHook
from kvsieve.cache.store_layout import StoreLayout, ordered_starts, run_capacities

#: Entries added per segment whenever an append does not fit (amortised O(1) appends at decoding).
GROWTH = 64
#: Decoding slots whose views a uniform layout makes at once (:meth:`StoreAppend._slot_views`).
SLOT_VIEWS = 64
#: Decoding steps whose rows a ragged layout computes at once (``(steps, segments)`` on the entries' device): a step
#: then takes its row of the table instead of computing the next rows.
ROW_TABLE_STEPS = 64


class StoreAppend(StoreLayout):
    """The append half of :class:`~kvsieve.cache.store.LayerStore`."""

    side_specs: dict[str, SideSpec]
    hooks: list[StoreHook]
    peak_length: int

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
        one_each = token_valid is None and q == 1  # every segment one entry at its end: a decoding step
        if not one_each:  # deferred side data lies back from the segments' ends by decoding appends only
            self.settle_deferred()
        if token_valid is None and self._uniform is not None:
            self._append_uniform(keys, values, first_position, q)
        else:
            self._append_ragged(keys, values, first_position, token_valid)
        self._one_each_appended = one_each
        self._one_each_appends += one_each  # once written (a growth before it settles with the count before it)
        self.peak_length = max(self.peak_length, self.max_length)

    def _append_uniform(self, keys: torch.Tensor, values: torch.Tensor, first_position: int, q: int) -> None:
        assert self._uniform is not None
        length, cap = self._uniform
        if length + q > cap:
            self._grow_uniform(length + q + GROWTH)
            length, cap = self._uniform
        if q == 1:  # a decoding step: views of its slot made ahead
            key_slot, value_slot, position_slot = self._slot_views(length)
            key_slot.copy_(keys)
            value_slot.copy_(values)
            position_slot.fill_(first_position)
        else:
            keys4, values4, positions4 = self.capacity_views()
            keys4.narrow(2, length, q).copy_(keys)
            values4.narrow(2, length, q).copy_(values)
            pos = positions4.narrow(2, length, q)
            pos.copy_(torch.arange(first_position, first_position + q, device=self.device).expand(pos.shape))
        if q == 1:  # the new slot only: pending deferred values stay pending
            if self._extras:
                for slot_view, fill in self._side_slot_views(length, cap):
                    slot_view.fill_(fill)
        else:
            for name, t in self._extras.items():
                t.view(self.batch, self.heads, cap, *t.shape[1:]).narrow(2, length, q).fill_(self.side_specs[name].fill)
        self._uniform = (length + q, cap)
        self._appended = (length, q)
        if self.hooks:
            for hook in self.hooks:
                hook.after_append(self, None, q)

    def _slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and positions of the uniform layout's ``slot`` (``(batch, heads, 1, ...)`` views; ``slot`` below
        the capacity). From the second decoding append into the same buffers on, taken from views of the next
        :data:`SLOT_VIEWS` slots made at once: three ``narrow`` calls per layer and decoding step cost ~11 µs on a slow
        CPU, a tenth of a small model's attention call. The first append into new buffers narrows as before, so a
        layout replaced at every step (every-step eviction by a gather) makes no views it would not use; one that
        keeps its buffers (an in-place drop: :meth:`~kvsieve.cache.store_compaction.StoreCompaction._dropped_in_place`)
        keeps its views."""
        views = self.capacity_views()
        cached = self._slot_cache
        if cached is not None and cached[0] is views and cached[2] is not None \
                and cached[1] <= slot < cached[1] + len(cached[2]):
            at = slot - cached[1]
            return cached[2][at], cached[3][at], cached[4][at]
        keys4, values4, positions4 = views
        if cached is None or cached[0] is not views:  # the first decoding append into these buffers
            self._slot_cache = (views, slot, None, None, None)
            return keys4.narrow(2, slot, 1), values4.narrow(2, slot, 1), positions4.narrow(2, slot, 1)
        count = min(SLOT_VIEWS, keys4.shape[2] - slot)
        made = (views, slot, keys4.narrow(2, slot, count).split(1, 2), values4.narrow(2, slot, count).split(1, 2),
                positions4.narrow(2, slot, count).split(1, 2))
        self._slot_cache = made
        return made[2][0], made[3][0], made[4][0]

    def _side_slot_views(self, slot: int, cap: int) -> tuple[tuple[torch.Tensor, float], ...]:
        """Each side-data buffer's view of the uniform layout's decoding ``slot`` ``(batch, heads, 1, ...)`` with the
        value a new entry starts at, made as :meth:`_slot_views` makes the entries' (issue 22: three operations per
        field and step were ~42 µs per layer for EMS's five fields on a slow CPU, against ~13 through these views):
        from the second decoding append into the same side buffers on, from views of the next :data:`SLOT_VIEWS`
        slots made at once."""
        sides = tuple(self._extras.values())
        cached = self._side_slot_cache
        if cached is not None and cached[0] == cap and len(cached[1]) == len(sides) \
                and all(a is b for a, b in zip(cached[1], sides, strict=True)):
            if cached[3] is not None and cached[2] <= slot < cached[2] + len(cached[3]):
                return cached[3][slot - cached[2]]
            count = min(SLOT_VIEWS, cap - slot)
            fills = [self.side_specs[name].fill for name in self._extras]
            split = [t.view(self.batch, self.heads, cap, *t.shape[1:]).narrow(2, slot, count).split(1, 2)
                     for t in sides]
            made = tuple(tuple(zip((views[at] for views in split), fills, strict=True)) for at in range(count))
            self._side_slot_cache = (cap, sides, slot, made)
            return made[0]
        # the first decoding append into these side buffers: a layout replaced at every step makes no views ahead
        self._side_slot_cache = (cap, sides, slot, None)
        return tuple((t.view(self.batch, self.heads, cap, *t.shape[1:]).narrow(2, slot, 1), self.side_specs[name].fill)
                     for name, t in self._extras.items())

    def _grow_uniform(self, capacity: int) -> None:
        assert self._uniform is not None
        self.settle_deferred()
        length, cap = self._uniform
        b, h = self.batch, self.heads

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((b * h * capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
            out.view(b, h, capacity, *t.shape[1:])[:, :, :length] = t.view(b, h, cap, *t.shape[1:])[:, :, :length]
            return out

        self.keys, self.values, self.positions = grow(self.keys), grow(self.values), grow(self.positions)
        self.extras = {name: grow(t) for name, t in self.extras.items()}
        self._uniform = (length, capacity)
        self._capacity_cache = self._slot_cache = self._side_slot_cache = None
        self._merge_buffers = None
        self._gather_cache = None
        self._segment_lookup = None

    def _append_one_each(self, keys: torch.Tensor, values: torch.Tensor, position: int) -> None:
        """Decoding on a ragged layout: one entry per segment, written in place; bookkeeping by increments."""
        segs = self.segments
        rows_ahead = self._next_rows
        if rows_ahead is None or self._next_step == len(rows_ahead):  # each segment's next rows, steps ahead, once
            steps = torch.arange(min(self._min_slack, ROW_TABLE_STEPS), dtype=torch.long)
            table = ((self._start + self._length)[None, :] + steps[:, None]).to(self.device)
            rows_ahead = self._next_rows = table.unbind(0)  # one view per step, made at once
            self._next_step = 0
            self._mask_cells = None  # the one-call mask's cells for these steps, made when first asked
            # free rows until these steps write them: their side data starts at its fill and their positions at the
            # ones consecutive steps give them now, once (a step whose position differs writes its own)
            rows = table.reshape(-1)
            for name, t in self._extras.items():  # free rows only: pending deferred values stay pending
                t.index_fill_(0, rows, self.side_specs[name].fill)
            self._table_position = position
            ahead = (position + steps).to(self.device)[:, None].expand(table.shape)
            self.positions.index_copy_(0, rows, ahead.reshape(-1))
        step = self._next_step
        dst = rows_ahead[step]  # a view made ahead: no tensor operation per step for the rows
        if position != self._table_position + step:
            self.positions.index_fill_(0, dst, position)
        self._next_step += 1
        if keys.dtype != self.dtype:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        self.keys.index_copy_(0, dst, keys.reshape(segs, self.head_dim))
        self.values.index_copy_(0, dst, values.reshape(segs, self.head_dim))
        if self._one_call_mask is not None:  # each segment's new row opened to its own query rows
            self._one_call_mask[2].view(-1).index_fill_(0, self._mask_cells_ahead()[step], 0.0)
        if self._row_bias is not None:  # the validity as the additive mask decoding reads; the boolean one from it
            self._row_bias.index_fill_(0, dst, 0.0)
            self._row_valid = None
        elif self._row_valid is not None:  # a padded layout's or strided runs' validity: the written rows, in place
            self._row_valid.index_fill_(0, dst, True)
        cached = self._gather_cache
        if cached is not None:  # extend the cached gather index by the new entries instead of rebuilding it
            if self._next_cols is None:  # each segment's next slot, kept on the device while the index is
                self._next_cols = self._length.to(self.device)
            col = self._next_cols[:, None]
            index, valid, width = cached
            if int(self._max_length) + 1 > width:
                index = torch.cat([index, index[:, -1:]], dim=1)
                valid = torch.cat([valid, torch.zeros_like(valid[:, -1:])], dim=1)
            index = index.scatter(1, col, dst[:, None])
            valid = valid.scatter(1, col, True)
            self._gather_cache = (index, valid, int(self._max_length) + 1)
            self._next_cols = self._next_cols + 1
        else:
            self._next_cols = None
        self._appended = (dst, None)  # one row per segment
        self._decoded += 1  # every segment's length, brought up to date when read (``StoreLayout._length``)
        if self._row_totals is not None:  # each row's total: one entry per head more
            self._row_totals = [total + self.heads for total in self._row_totals]
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
        self.settle_deferred()
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
        valid: torch.Tensor | None = None
        if token_valid is None:
            rows = base[:, None] + torch.arange(q, device=self.device)[None, :]
            dst = rows.reshape(-1)
            src_keys, src_values = keys.reshape(-1, self.head_dim), values.reshape(-1, self.head_dim)
            src_pos = positions.repeat(segs)
        else:
            valid = token_valid.to(self.device).repeat_interleave(h, dim=0)  # (segments, q)
            rank = valid.long().cumsum(dim=1) - 1
            rows = (base[:, None] + rank).clamp(min=0)  # padding tokens: some row of the buffer (never written)
            dst = rows[valid]
            src_keys = keys.reshape(segs, q, self.head_dim)[valid]
            src_values = values.reshape(segs, q, self.head_dim)[valid]
            src_pos = positions[None, :].expand(segs, q)[valid]
        self.keys.index_copy_(0, dst, src_keys.to(self.dtype))
        self.values.index_copy_(0, dst, src_values.to(self.dtype))
        self.positions.index_copy_(0, dst, src_pos)
        for name, t in self.extras.items():
            t.index_fill_(0, dst, self.side_specs[name].fill)
        self._set_ragged(self.start, length + counts, self.capacity, self._runs)
        self._appended = (rows, valid)
        for hook in self.hooks:
            hook.after_append(self, dst, q)

    def add_to_appended(self, name: str, values: torch.Tensor) -> None:
        """Add ``values`` ``(batch, heads, q)`` (one per token of the last append, padding tokens ignored) into
        side data ``name`` of the entries that append wrote: a decoding step touches one row per segment instead
        of the whole dense view (:meth:`add_dense`). Only between an append and the next layout change."""
        self.settle_deferred()
        record = self._appended
        if record is None:
            raise RuntimeError("add_to_appended: the store changed since its last append (or nothing was appended)")
        target = self.extras[name]
        self._dense_cache = None
        values = values.to(device=target.device, dtype=target.dtype)
        first, q = record
        if isinstance(first, int):  # a uniform append: slots [first, first + q) of every segment
            assert isinstance(q, int) and self._uniform is not None
            cap = self._uniform[1]
            target.view(self.batch, self.heads, cap, *target.shape[1:])[:, :, first : first + q] += values
            return
        rows, valid = record[0], record[1]
        assert isinstance(rows, torch.Tensor)
        flat = values.reshape(rows.shape + target.shape[1:])
        if valid is not None:  # padding tokens add zero (no boolean indexing: a host read on a GPU)
            mask = valid.view(*valid.shape, *([1] * (flat.dim() - 2)))
            flat = torch.where(mask, flat, torch.zeros((), dtype=target.dtype, device=target.device))
        target.index_add_(0, rows.reshape(-1), flat.reshape(-1, *target.shape[1:]))

    def defer_to_appended(self, name: str, inputs: torch.Tensor,
                          compute: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Side data ``name`` of the last append's entries from ``compute(inputs)``, computed when first read
        (:mod:`kvsieve.cache.deferred_side`) if that append was a decoding step's one entry per segment, else now
        (:meth:`add_to_appended`). ``inputs`` ``(batch, 1, ...)``; ``compute`` is the same function at every step."""
        if self._appended is None:
            raise RuntimeError("defer_to_appended: the store changed since its last append (or nothing was appended)")
        if not self._one_each_appended:
            self.add_to_appended(name, compute(inputs))
            return
        side = self._deferred.setdefault(name, DeferredSide(compute))
        side.inputs.append(inputs)
        side.appends.append(self._one_each_appends)
        self._dense_cache = None

    def _relayout(self, capacity: torch.Tensor) -> None:
        """Move every segment into fresh buffers with the given per-segment capacity (a padded layout stays
        padded: every segment gets the largest, its free rows copies of its last entry, as a compaction leaves
        them; strided runs stay runs: each run's segments get the run's largest, in the same order)."""
        self.settle_deferred()
        length, start = self.length, self.start
        padded = self._stride is not None and self.keys.shape[0] > 0
        runs, order = self._runs, None
        if padded:
            capacity = torch.full_like(capacity, int(capacity.max()))
        else:
            capacity, order = run_capacities(capacity, runs)
        new_start = ordered_starts(capacity, order)
        total = int(capacity.sum())
        if padded:
            offs = torch.arange(int(capacity[0]))
            source = (start[:, None] + torch.minimum(offs[None, :], (length - 1).clamp(min=0)[:, None])).reshape(-1)
            source = source.to(self.device)

            def move(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(0, source)
        else:
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
        self._set_ragged(new_start, length, capacity, runs)
