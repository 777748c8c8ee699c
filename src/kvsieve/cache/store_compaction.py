"""Compacting a layer store: keep chosen entries per segment, select batch rows, drop by position, and
edit entries in place (merges, side-data updates). Capacity shrinks to exactly what is kept, plus the rows
:meth:`StoreCompaction.reserving` asks for (a compaction while decoding leaves room for the appends until
the next one, so they are written in place instead of moving every segment again), or, for heads of similar
lengths, to the longest segment's for every one (a padded layout: :meth:`StoreCompaction.pads`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kvsieve.cache.length_groups import call_cost, compact_step_cost, partitions, plan_groups, run_call_cost
from kvsieve.cache.store_hook import StoreHook
from kvsieve.cache.store_layout import StoreLayout, ordered_starts, run_capacities
from kvsieve.native.evict_lowest import accumulate_and_evict, evict_lowest
from kvsieve.native.merge_lowest import GlobalLocalStep, RotaryCosSin, merge_lowest, prepare

#: The most padding a padded layout or strided runs may hold, as a share of the held entries
#: (:meth:`StoreCompaction.pads`, :meth:`StoreCompaction.plan_runs`) ...
MAX_PADDING = 0.25
#: ... or this many rows per segment, whichever is more: a layer whose heads hold a handful of entries each (KVzip's
#: and DBTrimKV's global budgets leave many such layers, e.g. 7, 4 and 4 entries) pads a few rows instead of
#: gathering them at every step, a few rows against the hundreds a cache holds per head.
SMALL_PADDING_ROWS = 16


def padding_limit(counts: torch.Tensor) -> float:
    """The most slots (held entries and padding) a layout of segments holding ``counts`` may allocate."""
    held = int(counts.sum())
    return held + max(MAX_PADDING * held, SMALL_PADDING_ROWS * counts.numel())


class StoreCompaction(StoreLayout):
    """The compaction half of :class:`~kvsieve.cache.store.LayerStore`."""

    written_sides: set[str]
    hooks: list[StoreHook]
    #: Free rows each segment keeps after a :meth:`keep` (set by :meth:`reserving`).
    _reserve: int = 0
    #: :meth:`drop_one`'s layout key, row table and shift offsets, for the one layout it was last built for.
    _drop_table: tuple[tuple[int, int, int, int], torch.Tensor, torch.Tensor] | None = None

    @contextmanager
    def reserving(self, rows: int) -> Iterator[None]:
        """Within the block, every :meth:`keep` leaves ``rows`` free rows at the end of each segment."""
        previous, self._reserve = self._reserve, max(0, int(rows))
        try:
            yield
        finally:
            self._reserve = previous

    def keep(self, local_index: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Keep, per segment ``s``, the entries ``local_index[s, :counts[s]]`` (ascending) and free the rest.

        ``local_index`` is ``(segments, K)`` of indices into each segment; the kept entries are exact
        copies of the originals, in their original order. Capacity shrinks to exactly what is kept (plus
        the :meth:`reserving` rows). Returns the flat source rows that were kept (before the move), for
        callers that merge.
        """
        self.settle_deferred()
        counts = counts.to(torch.long).cpu().reshape(-1)
        kept = int(counts[0]) if counts.numel() else 0
        if self._uniform is not None and kept and bool((counts == kept).all()):
            return self._keep_uniform(local_index[:, :kept], kept)
        width = local_index.shape[1]
        mask = torch.arange(width)[None, :] < counts[:, None]
        src = (self.start[:, None].to(local_index.device) + local_index)[mask.to(local_index.device)]
        total = int(counts.sum())
        src = src.to(self.device)
        capacity = counts + self._reserve
        runs = None
        if self.pads(counts):  # equal capacities: a zero-copy padded view (module docstring of store_layout)
            capacity = torch.full_like(counts, int(counts.max()) + self._reserve)
        elif total:
            runs = self.plan_runs(counts)  # each run's segments back to back with the run's capacity
        capacity, order = run_capacities(capacity, runs)
        new_start = ordered_starts(capacity, order)
        rows = src
        if total and (order is not None or bool((capacity > counts).any())):
            # one gather fills each segment's kept rows and, past them, repeats its last one (free rows), segments
            # in buffer order
            kept_start = torch.cumsum(counts, 0) - counts
            offs = torch.arange(int(capacity.max()))
            within = offs[None, :] < capacity[:, None]
            pick = kept_start[:, None] + torch.minimum(offs[None, :], (counts - 1).clamp(min=0)[:, None])
            if order is not None:
                pick, within = pick[order], within[order]
            rows = src.index_select(0, pick[within].clamp(max=total - 1).to(self.device))

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, rows) if total else t[:0].clone()

        self.keys, self.values, self.positions = take(self.keys), take(self.values), take(self.positions)
        self.extras = {name: take(t) for name, t in self.extras.items()}
        self._set_ragged(new_start, counts, capacity if total else counts.clone(), runs)
        self._layout_changed()
        return src

    def pads(self, counts: torch.Tensor) -> bool:
        """Whether a compaction keeping ``counts`` (host, per segment, not all equal) lays the segments out padded:
        equal capacities, so a decoding step attends over a zero-copy view instead of gathering every held entry
        into a padded copy (``segments × longest`` slots) at every layer and step.

        Chosen when a decoding step would attend over one padded view anyway (:func:`plan_groups` finds no length
        groups worth their calls) and the padding is at most :data:`MAX_PADDING` of the held entries (or
        :data:`SMALL_PADDING_ROWS` per segment, :func:`padding_limit`): the buffers
        then hold up to that many more rows between steps (allocated, not held: ``KVCache.storage()`` reports
        both). Measured on the default model (4k prompt, AdaKV at 256, float32): with no cap on the padding a
        decoding step went from 1.21–1.28 to 1.15× a ``DynamicCache``'s at batch 8 (level at batch 1) for 14% more
        allocated bytes; the 25% cap pads 18 of 30 layers at batch 1 (+7% allocated), 5 at batch 4 (+3%), and gains
        correspondingly less (``benchmarks/results/engine_overhead_float32*.json``). Heads of very different lengths
        stay compact (length groups)."""
        if counts.numel() < 2 or int(counts.min()) == int(counts.max()):
            return False
        if counts.numel() * int(counts.max()) > padding_limit(counts):
            return False
        return plan_groups(counts, call_cost(self.device)) is None

    def plan_runs(self, counts: torch.Tensor) -> tuple[tuple[int, ...], ...] | None:
        """The strided runs a compaction keeping ``counts`` (host, per segment) lays the segments out in, or None
        (compact or padded): when a decoding step would attend by length group (:func:`plan_groups`) and padding
        the segments of 2 to :data:`~kvsieve.cache.length_groups.MAX_GROUPS` runs of similar lengths to each run's
        longest costs at most :func:`padding_limit`, each run gets equal capacities back to back,
        which a decoding step attends as a zero-copy view of the buffers instead of gathering its entries at every
        layer and step (DBTrimKV's global budget at batch 8 made ~12 gathers per layer and step; KVzip's;
        DuoAttention's heads). Among the cuts under the cap: the fewest padded slots plus
        :data:`~kvsieve.cache.length_groups.RUN_CALL_COST` per run. Measured (default model's shapes, batch 8, bf16,
        one layer's decoding attention): DBTrimKV's heads of 57 / 707 / 1,313 entries 838 → 329 µs, of
        126 / 379 / 601 504 → 194 µs, against 237 and 118 µs for a uniform cache holding as many entries.

        Also, on a CPU, where no length groups pay but one padded layout would exceed the cap (the layout was then
        compact, its step gathering a padded view of every entry): runs under the cap when they cost less than that
        gather (:func:`~kvsieve.cache.length_groups.compact_step_cost`). AdaKV at 256 (default model, 4k, bf16): 13 of
        30 layers at batch 8 and 8 at batch 1 were compact; as runs its step went 1.196 → 1.137× snapkv's at batch 8
        (``benchmarks/results/engine_overhead_*_compact_runs.json``)."""
        if counts.numel() < 2 or int(counts.min()) == int(counts.max()):
            return None
        # without length groups worth their calls, the alternative is the compact layout (the caller pads only
        # under the cap): its step gathers a padded view of every held entry, which runs must cost less than
        compact = None
        every_cut = partitions(counts)  # once: the length groups and the runs below read the same cuts
        if plan_groups(counts, call_cost(self.device), every_cut) is None:
            if counts.numel() * int(counts.max()) <= padding_limit(counts):
                return None  # padded: one zero-copy view (:meth:`pads`)
            compact = compact_step_cost(counts.numel(), int(counts.max()), self.device)
            if compact is None:
                return None
        # as few runs as the padding cap allows, each one more worth RUN_CALL_COST slots (no gather in a run)
        limit, cost = padding_limit(counts), run_call_cost(self.device)
        cuts = {g: cut for g, cut in every_cut.items() if g >= 2 and cut[0] <= limit}
        if not cuts:
            return None
        best = min(cuts, key=lambda g: cuts[g][0] + g * cost)
        if compact is not None and cuts[best][0] + best * cost >= compact:
            return None
        # laid out as close to segment order as the cut allows (each run's segments ascending, runs by their first):
        # where that is segment order, a decoding step reorders neither its queries nor its outputs
        runs = sorted(sorted(members.tolist()) for members, _, _ in cuts[best][1])
        return tuple(tuple(run) for run in runs)

    def _keep_uniform(self, local_index: torch.Tensor, kept: int) -> torch.Tensor:
        """:meth:`keep` of a uniform store where every segment keeps ``kept`` entries: the layout stays uniform
        (``kept`` entries and the reserved rows per segment, which repeat the last kept one), one gather per
        buffer and no host work beyond the layout's two ints (every-step decoding eviction's steady state takes
        :meth:`drop_one` instead; this path when its plan came from the general path)."""
        assert self._uniform is not None
        cap = self._uniform[1]
        local = local_index.to(self.device)
        first_row = torch.arange(self.segments, device=self.device)[:, None] * cap
        src = (first_row + local).reshape(-1)
        if self._reserve:
            local = torch.cat([local, local[:, -1:].expand(-1, self._reserve)], dim=1)
        rows = (first_row + local).reshape(-1)
        self.keys, self.values, self.positions = (
            self.keys.index_select(0, rows), self.values.index_select(0, rows), self.positions.index_select(0, rows)
        )
        self.extras = {name: t.index_select(0, rows) for name, t in self.extras.items()}
        self._set_uniform(kept, kept + self._reserve)
        self._layout_changed()
        return src

    def drop_one(self, dropped: torch.Tensor) -> None:
        """:meth:`keep` of a uniform store where every segment drops one entry, its local index ``dropped[s]``
        (every-step decoding eviction): the same buffers and layout (``length - 1`` entries and the reserved rows
        per segment), each buffer moved by one gather whose index is the layout's cached row table plus one past
        the dropped entry — two device operations to build it instead of the general path's host arithmetic,
        top-k order and count checks."""
        self.settle_deferred()
        assert self._uniform is not None
        length, cap = self._uniform
        kept = length - 1
        key = (self.segments, cap, kept, self._reserve)
        table = self._drop_table
        if table is None or table[0] != key or table[1].device != self.device:
            width = kept + self._reserve
            offsets = torch.arange(width, device=self.device)
            # the reserved rows (free: their content is never read) come from the segment's own rows, unshifted
            rows = (torch.arange(self.segments, device=self.device)[:, None] * cap
                    + offsets.clamp(max=cap - 1)[None, :])
            shifted = torch.where(offsets < kept, offsets, -1)  # compared with `dropped`: a reserved row never shifts
            table = self._drop_table = (key, rows, shifted)
        _, rows, shifted = table
        index = (rows + (shifted[None, :] >= dropped.to(self.device)[:, None])).reshape(-1)
        self.keys, self.values, self.positions = (
            self.keys.index_select(0, index), self.values.index_select(0, index), self.positions.index_select(0, index)
        )
        self.extras = {name: t.index_select(0, index) for name, t in self.extras.items()}
        self._set_uniform(kept, kept + self._reserve)
        self._layout_changed()

    def drop_lowest(self, rows: torch.Tensor, accumulator: str, candidates: int, reserve: int) -> bool | None:
        """A decoding step's observation and :meth:`drop_one` in place, for a scorer whose score is side data
        ``accumulator`` summing each query's attention (H2O's): add each KV head's group mean of ``rows``
        ``(batch, q_heads, 1, L)`` (the new query's float32 softmax rows over the held entries) to it, then drop each
        segment's entry with the lowest sum among its first ``candidates`` (the newest ones are protected), every
        buffer moved by one row in place — what the engine's observation, :meth:`LayerPlans._drop_one
        <kvsieve.engine.layer_plans.LayerPlans._drop_one>` and :meth:`drop_one` compute, bit for bit
        (:mod:`kvsieve.native.evict_lowest`), in place: only where the buffers already have the capacity
        :meth:`drop_one` would leave under ``reserving(reserve)`` (the kept entries and ``reserve`` free rows).

        True: dropped. False: some segment's lowest sum is tied (or NaN) — the sums were added, nothing moved; the
        caller plans on the general path without observing again. None: not taken, nothing changed (not a uniform
        store without hooks or deferred side data, another capacity, off the CPU, no built pass)."""
        if not self._drops_in_place(reserve) or accumulator not in self._extras:
            return None
        assert self._uniform is not None
        return self._dropped_in_place(accumulate_and_evict(
            rows, self.heads, self._extras[accumulator], self._uniform[1], candidates, self._buffers()))

    def drop_lowest_scored(self, scores: torch.Tensor, candidates: int, reserve: int) -> bool | None:
        """:meth:`drop_lowest` of scores a decoding step computed (TOVA's last-query attention) ``(batch, heads, L)``,
        or ``(batch, 1, L)`` shared by a batch item's heads — then only where they hold the same positions (the
        pass checks): no side data is updated. The same results (False: a tie, nothing moved)."""
        if not self._drops_in_place(reserve):
            return None
        assert self._uniform is not None
        positions = self.positions if scores.shape[1] == 1 and self.heads > 1 else None
        return self._dropped_in_place(evict_lowest(scores, self.heads, self._uniform[1], candidates,
                                                   self._buffers(), positions))

    def merge_lowest(self, rows: torch.Tensor, sides: tuple[str, str, str, str], counts: str, candidates: int,
                     reserve: int, ems: GlobalLocalStep, rotary: RotaryCosSin) -> bool | None:
        """EMS's decoding step in place (:mod:`kvsieve.native.merge_lowest`): observe ``rows`` into the Global-Local
        score's side data ``sides`` (s_glo, s_loc's past and current parts, the current part's row count), then
        give up each segment's lowest-scoring entry among its first ``candidates`` — merged into its most redundant
        centre (key, value and side data ``counts`` rewritten) or evicted — and drop it, every buffer moved by one
        row in place, under :meth:`drop_lowest`'s conditions. True: done. False: a decision within the pass's margin
        (the side data observed, nothing else changed): the caller plans on the general path without observing
        again. None: not taken, nothing changed."""
        if not self._drops_in_place(reserve) or any(name not in self._extras for name in (*sides, counts)):
            return None
        assert self._uniform is not None
        extras = self._extras
        tensors = (*(extras[name] for name in sides), extras[counts], self.keys, self.values, self.positions,
                   *self._buffers())
        prepared = self._merge_buffers
        if prepared is None or not prepared.holds(tensors):  # checked once while the buffers stay
            prepared = self._merge_buffers = prepare(self.segments, tensors[:4], tensors[4], self._uniform[1],
                                                     self.keys, self.values, self.positions, self._buffers())
            if prepared is None:
                return None
        result = merge_lowest(rows, self.heads, prepared, candidates, ems, rotary)
        if result is None or result is False:
            return result
        dropped, merged = result
        if merged:
            self.written_sides.add(counts)  # every attention path now adds log(count) (LayerStep.bias)
        return self._dropped_in_place(dropped)

    def _drops_in_place(self, reserve: int) -> bool:
        """A uniform store without hooks or deferred side data whose buffers have :meth:`drop_one`'s capacity after
        one entry per segment goes (a prompt's compaction leaves no free row: the first decoding drop shrinks them)."""
        if self._uniform is None or self.hooks or self._deferred:
            return False
        length, cap = self._uniform
        return cap == length - 1 + reserve

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.values, self.positions, *self._extras.values())

    def _dropped_in_place(self, dropped: torch.Tensor | bool | None) -> bool | None:
        """The layout after the pass dropped one entry per segment in place (the same buffers and capacity)."""
        if dropped is None or dropped is False:
            return dropped
        assert self._uniform is not None
        length, cap = self._uniform
        # the same buffers: their views stay
        kept = self._capacity_cache, self._merge_buffers, self._slot_cache, self._side_slot_cache
        self._set_uniform(length - 1, cap)
        self._capacity_cache, self._merge_buffers, self._slot_cache, self._side_slot_cache = kept
        self._layout_changed()
        return True

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder / select batch items (beam search, batch filtering)."""
        self.settle_deferred()
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
        self._layout_changed()

    def keep_positions_before(self, limit: int) -> None:
        """Drop every entry at position ``limit`` or later (rollback of the last tokens)."""
        self._keep_where(lambda positions: positions < limit)

    def keep_positions_after(self, min_position: int) -> None:
        """Drop every entry whose position is below ``min_position`` (sliding-window layers)."""
        self._keep_where(lambda positions: positions >= min_position)

    def _keep_where(self, predicate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.settle_deferred()
        view = self.dense()
        keep = predicate(view.positions)
        if view.valid is not None:
            keep = keep & view.valid
        counts = keep.sum(dim=-1).reshape(-1).cpu()
        if bool((counts == self.lengths().reshape(-1)).all()):  # every tier counted
            return
        width = keep.shape[-1]
        order = torch.where(keep, torch.arange(width, device=keep.device), width)
        local = torch.sort(order.reshape(self.segments, width), dim=-1).values
        self.keep(local, counts)

    def add_dense(self, name: str, values: torch.Tensor) -> None:
        """Add ``(batch, heads, L, ...)`` values (laid out like :meth:`dense`) into side data ``name``."""
        self.settle_deferred()
        target = self.extras[name]
        self._dense_cache = None
        if self._uniform is not None:
            cap = self._uniform[1]
            view = target.view(self.batch, self.heads, cap, *target.shape[1:])
            view.narrow(2, 0, values.shape[2]).add_(values.to(target.dtype))  # in place: no write-back copy
            return
        index, valid, _ = self.gather_index()
        flat_values = values.reshape(self.segments, -1, *target.shape[1:]).to(target.dtype)
        # padding slots add zero (no boolean indexing: its size would be a host read on a GPU)
        mask = valid.view(*valid.shape, *([1] * (flat_values.dim() - 2)))
        added = torch.where(mask, flat_values, torch.zeros((), dtype=target.dtype, device=target.device))
        target.index_add_(0, index.reshape(-1), added.reshape(-1, *target.shape[1:]))

    def write_rows(self, rows: torch.Tensor, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                   extras: dict[str, torch.Tensor] | None = None) -> None:
        """Overwrite entries at flat ``rows`` in place (merges); positions and layout are unchanged."""
        self.settle_deferred()
        self._dense_cache = None
        self.written_sides.update(extras or {})
        if keys is not None:
            self.keys.index_copy_(0, rows, keys.to(self.dtype))
        if values is not None:
            self.values.index_copy_(0, rows, values.to(self.dtype))
        for name, t in (extras or {}).items():
            self.extras[name].index_copy_(0, rows, t.to(self.extras[name].dtype))
        self._layout_changed()
