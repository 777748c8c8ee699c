"""Precision tiers of a layer store: full-precision entries in the store's buffers, lower tiers packed.

A store may own :class:`~kvsieve.cache.quantized_tier.QuantizedTier` objects (one per bit width). While
any tier holds entries, the store's dense view is the **combined** view: per segment, every entry of
every tier, in position order, dequantized to the model dtype, padded at the end — so the kernel,
statistics, scorers and selectors read quantized entries exactly as they read full-precision ones, and "the
first ``n`` slots are the head's entries, newest last" holds as it does without tiers. :meth:`StoreTiers.keep`
takes indices into that view, routes each kept entry to where it lives and moves the chosen full-precision
entries into a tier. Without tier entries every method is the plain store's (no cost).

A quantized entry keeps its side data per slot in its tier (:meth:`StoreTiers.add_dense` routes updates there).
Hooks (a selector's pages and sums) read the combined view: an operation that changes the full-precision store
and then the tiers tells them once, at its end (:meth:`StoreTiers._one_layout_change`). :meth:`StoreTiers.entries`
and :meth:`StoreTiers.restore` save and load the tiers as held (packed), for saved contexts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvsieve.cache.dense_view import DenseView
from kvsieve.cache.quantized_tier import QuantizedTier
from kvsieve.cache.store_compaction import StoreCompaction
from kvsieve.native.tiered_attention import PackedTier
from kvsieve.native.tiered_attention import attend as attend_tiers

#: Prefix of a tier's tensors in :meth:`StoreTiers.entries` (``tier.0.key_codes``, ...).
TIER_PREFIX = "tier."


class StoreTiers(StoreCompaction):
    """The tier half of :class:`~kvsieve.cache.store.LayerStore` (see the module docstring)."""

    tiers: list[QuantizedTier]
    _combined: tuple[DenseView, DenseView, torch.Tensor, torch.Tensor, tuple[int, ...]] | None
    #: Small tensors derived from the tiers' bookkeeping, per device (cleared whenever the tiers change).
    _derived: dict[tuple[object, ...], torch.Tensor]
    #: Each tier's bytes per segment in full-precision entries (Python floats), with the tiers and versions they are of.
    _tier_units: tuple[tuple[tuple[object, int], ...], list[list[float]]] | None
    #: Each non-empty tier as the CPU's decoding pass reads it, with the tiers and versions they are of.
    _packed_tiers: tuple[tuple[tuple[object, int, int], ...], list[PackedTier]] | None

    def add_tier(self, bits: int, group: int, value_group: int) -> int:
        """Create a tier at ``bits`` bits (KIVI groups of ``group`` tokens, ``value_group`` channels); its index."""
        tier = QuantizedTier(self.batch, self.heads, self.head_dim, bits, group, value_group, self.dtype, self.device)
        for spec in self.side_specs.values():  # type: ignore[attr-defined]
            tier.ensure_side(spec)
        self.tiers.append(tier)
        self._combined = None
        self._derived = {}
        return len(self.tiers) - 1

    @property
    def tiered(self) -> bool:
        """Whether any tier holds entries (then :meth:`dense` is the combined view)."""
        return bool(self.tiers) and any(not tier.empty for tier in self.tiers)

    # ------------------------------------------------------------------ sizes
    def lengths(self) -> torch.Tensor:
        """Entries held per (batch item, KV head), every tier counted, ``(batch, heads)`` (host tensor)."""
        out = super().lengths()
        for tier in self.tiers:
            out = out + tier.lengths()
        return out

    def row_totals(self) -> list[int]:
        """Entries held per batch row, every head and tier counted (Python ints)."""
        if not self.tiers:
            return super().row_totals()
        return [int(total) for total in self.lengths().sum(dim=1).tolist()]

    def tier_lengths_on(self, device: torch.device) -> torch.Tensor:
        """:meth:`tier_lengths` on ``device``, kept until the tiers change (a decoding append reads it at every step
        of a selector's hooks: no host-to-device copy then)."""
        cached = self._derived.get(("lengths", str(device)))
        if cached is None:
            cached = self._derived[("lengths", str(device))] = self.tier_lengths().to(device)
        return cached

    def dense_slots(self, local: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """Slots in :meth:`dense` of newly appended full-precision entries at ``local`` slots of ``segments`` (device
        tensors): appends are the newest entries, so they follow every quantized entry of their segment."""
        if not self.tiered:
            return local
        return local + self.tier_lengths_on(local.device)[segments]

    def entry_nbytes_on(self, device: torch.device, values_only: bool = False) -> torch.Tensor:
        """Bytes one entry costs as held, per origin (0: the model dtype, ``t ≥ 1``: ``self.tiers[t - 1]``, its
        share of its group's codes, steps and minimums), float64 on ``device``; keys and values, or values only.
        Kept until the tiers change."""
        key = ("entry_nbytes", str(device), values_only)
        cached = self._derived.get(key)
        if cached is None:
            cached = self._derived[key] = torch.tensor(
                [self.full_entry_nbytes(values_only), *(tier.group_nbytes(values_only) / tier.group
                                                        for tier in self.tiers)],
                dtype=torch.float64, device=device)
        return cached

    def full_entry_nbytes(self, values_only: bool = False) -> int:
        """Bytes of one full-precision key + value (or value alone)."""
        return self.head_dim * (self.values.element_size() if values_only else
                                self.keys.element_size() + self.values.element_size())

    def tier_lengths(self) -> torch.Tensor:
        """Quantized entries per segment ``(segments,)`` (host tensor; zeros without tiers): a full-precision
        entry at slot ``i`` of its segment that is newer than every quantized one sits at ``i`` plus this in
        :meth:`dense` (appends are newest, so hooks place them with it)."""
        out = torch.zeros(self.segments, dtype=torch.long)
        for tier in self.tiers:
            out = out + tier.counts
        return out

    @property
    def held_max_length(self) -> int:
        """Most entries any segment holds, every tier counted (a Python int; ``max_length`` without tiers)."""
        if not self.tiered:
            return self.max_length
        lengths = self.lengths()
        return int(lengths.max()) if lengths.numel() else 0

    def full_lengths(self) -> torch.Tensor:
        """Full-precision entries per (batch item, KV head) (host tensor)."""
        return super().lengths()

    def kv_nbytes(self) -> int:
        return super().kv_nbytes() + sum(tier.kv_nbytes() for tier in self.tiers)

    def full_entry_units(self) -> torch.Tensor:
        """Key/value bytes held per segment in full-precision entries ``(segments,)`` (host float64): its
        full-precision entries plus its quantized groups' bytes."""
        units = self.length.double()
        for part in self._tier_unit_parts():
            units = units + torch.tensor(part, dtype=torch.float64)
        return units

    def max_full_entry_units(self) -> int:
        """The most key/value bytes any head holds, in full-precision entries (rounded up): full-precision
        entries plus its quantized groups' bytes — what a byte budget in full entries is compared with.

        Asked at every decoding step of every layer under a byte budget, so it is computed on Python floats: each
        tier's share per segment is kept until a tier changes (:meth:`_tier_unit_parts`, which :meth:`full_entry_units`
        adds too), and a segment's units are summed in the same order with the same float64 operations — the same
        number as the tensor form, without its ten small tensor operations per layer and step (mixed / restkv
        decoding 1.357 → 1.331 in one process)."""
        if not self.tiered:
            return self.max_length
        parts = self._tier_unit_parts()
        lengths = [self.max_length] * self.segments if self.is_uniform else self.length.tolist()
        most: float | None = None
        for segment, held in enumerate(lengths):
            units = float(held)
            for part in parts:
                units = units + part[segment]
            if most is None or units > most:
                most = units
        return 0 if most is None else math.ceil(most)

    def _tier_unit_parts(self) -> list[list[float]]:
        """Each tier's key/value bytes per segment in full-precision entries (float64 bytes over a full entry's bytes),
        as Python floats; kept until a tier is added or changes."""
        key = tuple((tier, tier.version) for tier in self.tiers)
        cached = self._tier_units
        if cached is None or cached[0] != key:
            per_full_entry = 2 * self.head_dim * self.keys.element_size()
            parts = [(tier.segment_kv_nbytes().double() / per_full_entry).tolist() for tier in self.tiers]
            cached = self._tier_units = (key, parts)
        return cached[1]

    def used_nbytes(self) -> int:
        return super().used_nbytes() + sum(tier.nbytes() for tier in self.tiers)

    # ------------------------------------------------------------------ the combined view
    def dense(self) -> DenseView:
        full = super().dense()
        if not self.tiered:
            return full
        version = tuple(tier.version for tier in self.tiers)
        if self._combined is not None and self._combined[0] is full and self._combined[4] == version:
            return self._combined[1]
        view, tier_of, slot_of = self._combine(full)
        self._combined = (full, view, tier_of, slot_of, version)
        return view

    def view_nbytes(self) -> int:
        """Also the combined view (every entry dequantized, in position order) and its origin maps while cached."""
        out = super().view_nbytes()
        if self._combined is not None:
            _, view, tier_of, slot_of, _ = self._combined
            out += sum(t.nbytes for t in (view.keys, view.values, view.valid, tier_of, slot_of) if t is not None)
        return out

    def release_views(self) -> None:
        """Also drop the combined view: every entry dequantized to the model dtype (several times the packed bytes)."""
        super().release_views()
        self._combined = None

    def attention_view(self) -> DenseView:
        """Every held entry for attention, **not** in position order: the full-precision view, then each tier's
        slots (:meth:`QuantizedTier.attention_parts`). Attention depends on the entries and their positions, not
        their order, so a decoding step reads this instead of :meth:`dense`: it dequantizes, but neither sorts nor
        gathers. Without tier entries it is :meth:`dense`. The view is allocated once, the full-precision entries
        copied into its front and each tier dequantized straight into its slice (a concatenation would copy the
        dequantized entries a second time)."""
        full = super().dense()
        if not self.tiered:
            return full
        tiers = [tier for tier in self.tiers if not tier.empty]
        widths = [full.keys.shape[2], *(tier.attention_layout()[1].shape[2] for tier in tiers)]
        shape = (self.batch, self.heads, sum(widths), self.head_dim)
        keys = torch.empty(shape, dtype=full.keys.dtype, device=self.device)
        values = torch.empty(shape, dtype=full.values.dtype, device=self.device)
        keys[:, :, : widths[0]].copy_(full.keys)
        values[:, :, : widths[0]].copy_(full.values)
        parts = []
        offset = widths[0]
        for tier, width in zip(tiers, widths[1:], strict=True):
            window = slice(offset, offset + width)
            parts.append(tier.attention_parts((keys[:, :, window], values[:, :, window])))
            offset += width
        valids = [full.valid, *(part[3] for part in parts)]
        valid = None
        if any(v is not None for v in valids):
            shapes = [full.keys.shape[:3], *(part[0].shape[:3] for part in parts)]
            valid = torch.cat([v if v is not None else torch.ones(shape, dtype=torch.bool, device=self.device)
                               for v, shape in zip(valids, shapes, strict=True)], dim=2)
        extras = full.extras
        if extras:  # each tier keeps its entries' side data per slot
            tier_extras = [tier.dense_extras() for tier in self.tiers if not tier.empty]
            extras = {name: torch.cat([extra, *(part[name].to(extra.dtype) for part in tier_extras)], dim=2)
                      for name, extra in extras.items()}

        def fetch(name: str) -> torch.Tensor:
            return torch.cat([full.positions, *(part[2] for part in parts)], dim=2)

        return DenseView(keys, values, None, valid, extras, fetch, ())

    def decoding_output(self, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """A decoding query's softmax attention ``(batch, 1, q_heads, d)`` over every held entry, read in place: the
        full-precision entries where they lie and each tier's packed codes in its slot layout
        (:func:`kvsieve.native.tiered_attention.attend`: no dequantized view). None where that pass does not apply
        (off the CPU, among others); the caller then attends over :meth:`attention_view`."""
        full = super().dense()
        # the buffers' address too: a deep copy of the store copies this cache with the versions (and the addresses
        # its descriptors hold), and must read its own buffers
        key = tuple((tier, tier.version, tier.key_codes.data_ptr()) for tier in self.tiers)
        cached = self._packed_tiers
        if cached is None or cached[0] != key:
            parts = []
            for tier in self.tiers:
                if tier.empty:
                    continue
                index, positions, valid = tier.attention_layout()
                parts.append(PackedTier(tier.bits, tier.group, tier.value_group, tier.key_codes, tier.key_params,
                                        tier.value_codes, tier.value_params, index, valid, positions.shape[2]))
            cached = self._packed_tiers = (key, parts)
        return attend_tiers(query, scaling, full.keys, full.values, full.valid, cached[1])

    def _combine(self, full: DenseView) -> tuple[DenseView, torch.Tensor, torch.Tensor]:
        b, h = self.batch, self.heads
        full_valid = full.valid if full.valid is not None else torch.ones(
            full.positions.shape, dtype=torch.bool, device=self.device)
        parts_k, parts_v, parts_p, parts_ok = [full.keys], [full.values], [full.positions], [full_valid]
        parts_x = {name: [extra] for name, extra in full.extras.items()}
        tier_of = [torch.zeros(full.positions.shape, dtype=torch.long, device=self.device)]
        slot_of = [torch.arange(full.length, device=self.device).expand(b, h, -1)]
        for index, tier in enumerate(self.tiers, start=1):
            keys, values, positions, valid = tier.dense()
            parts_k.append(keys)
            parts_v.append(values)
            parts_p.append(positions)
            parts_ok.append(valid)
            tier_extras = tier.dense_extras()
            for name, parts in parts_x.items():
                parts.append(tier_extras[name].to(parts[0].dtype))
            tier_of.append(torch.full(positions.shape, index, dtype=torch.long, device=self.device))
            slot_of.append(torch.arange(positions.shape[2], device=self.device).expand(b, h, -1))
        valid = torch.cat(parts_ok, dim=2)
        positions = torch.cat(parts_p, dim=2)
        big = torch.iinfo(torch.long).max
        order = torch.sort(torch.where(valid, positions, big), dim=2, stable=True).indices
        width = int(self.lengths().max())
        order = order[:, :, :width]

        def take(t: torch.Tensor) -> torch.Tensor:
            index = order if t.dim() == 3 else order.unsqueeze(-1).expand(*order.shape, t.shape[-1])
            return torch.gather(t, 2, index)

        keys, values = take(torch.cat(parts_k, dim=2)), take(torch.cat(parts_v, dim=2))
        kept_valid = take(valid)
        extras = {}
        for name, parts in parts_x.items():
            joined = torch.cat(parts, dim=2)
            index = order.view(*order.shape, *([1] * (joined.dim() - 3))).expand(*order.shape, *joined.shape[3:])
            extras[name] = torch.gather(joined, 2, index)
        view = DenseView(keys, values, take(positions), None if bool(kept_valid.all()) else kept_valid, extras)
        return view, take(torch.cat(tier_of, dim=2)), take(torch.cat(slot_of, dim=2))

    def _origins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Tier (0: full precision) and slot in that tier's own view of every combined-view slot."""
        self.dense()
        assert self._combined is not None
        return self._combined[2], self._combined[3]

    def origins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each slot of :meth:`dense` lives, ``(batch, heads, L)`` each: its tier (0: the model dtype,
        ``t ≥ 1``: ``self.tiers[t - 1]``) and its slot in that tier's own view (a quantized entry's group is
        ``slot // group``); without tier entries, tier 0 and the slot itself."""
        if self.tiered:
            return self._origins()
        view = self.dense()
        shape = view.keys.shape[:3]
        slots = torch.arange(shape[2], device=self.device).expand(shape)
        return torch.zeros(shape, dtype=torch.long, device=self.device), slots

    # ------------------------------------------------------------------ compaction across tiers
    def keep(self, local_index: torch.Tensor, counts: torch.Tensor, tiers: torch.Tensor | None = None) -> torch.Tensor:
        """Keep ``local_index[s, :counts[s]]`` of the dense (combined) view and free the rest.

        ``tiers`` ``(segments, K)``: the tier each kept *full-precision* entry moves to (0: stays in full
        precision; ``t ≥ 1``: quantized into ``self.tiers[t - 1]``); entries already quantized stay in their
        tier. Everything is read from one view before anything moves. Returns the kept full-precision rows
        (before the move), as the plain store does.
        """
        self.settle_deferred()
        if not self.tiered and (tiers is None or not bool((tiers > 0).any())):
            return super().keep(local_index, counts)
        view = self.dense()
        b, h, device = self.batch, self.heads, self.device
        counts = counts.to(torch.long).cpu().reshape(-1)
        width = local_index.shape[1]
        chosen = torch.arange(width, device=device)[None, :] < counts.to(device)[:, None]
        index = local_index.to(device).clamp(max=max(view.length - 1, 0))
        if self.tiered:
            tier_of, slot_of = self._origins()
            origin = torch.gather(tier_of.reshape(b * h, -1), 1, index)
            slots = torch.gather(slot_of.reshape(b * h, -1), 1, index)
        else:
            origin, slots = torch.zeros_like(index), index
        target = torch.zeros_like(index) if tiers is None else tiers.to(device).to(torch.long)
        moving: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
        for number in range(1, len(self.tiers) + 1):
            pick = chosen & (origin == 0) & (target == number)
            if bool(pick.any()):
                moving.append((number - 1, *self._gather(view, index, pick), pick.sum(dim=1).cpu(),
                               self._gather_extras(view, index, pick)))
        rows = torch.arange(b * h, device=device)[:, None].expand_as(slots)
        for number, tier in enumerate(self.tiers, start=1):
            if tier.empty:
                continue
            mask = torch.zeros(b * h, int(tier.groups_per_segment.max()) * tier.group, dtype=torch.bool,
                               device=device)
            pick = chosen & (origin == number)
            mask[rows[pick], slots[pick]] = True
            tier.keep(mask.view(b, h, -1))
        stay = chosen & (origin == 0) & (target == 0)
        full_counts = stay.sum(dim=1).cpu()
        order = torch.where(stay, slots, torch.iinfo(torch.long).max)
        kept_width = int(full_counts.max()) if full_counts.numel() else 0
        full_local = torch.sort(order, dim=1).values[:, :kept_width].clamp(max=max(self.max_length - 1, 0))
        with self._one_layout_change():
            src = super().keep(full_local, full_counts)
            for tier_index, keys, values, positions, per_segment, extras in moving:
                self.tiers[tier_index].add(keys, values, positions, per_segment, extras)
        return src

    @contextmanager
    def _one_layout_change(self) -> Iterator[None]:
        """Within the block the full-precision store and the tiers change in turn; hooks (a selector's pages and
        sums, which read the combined view) are told once, at the end, when the view is whole again."""
        outer, self._hooks_deferred = self._hooks_deferred, True
        try:
            yield
        finally:
            self._hooks_deferred = outer
            self._combined = None
            self._derived = {}
        self._layout_changed()

    def _gather(self, view: DenseView, index: torch.Tensor, pick: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and positions of the picked entries, segment by segment, in position order."""
        segments, length, d = self.batch * self.heads, view.length, self.head_dim
        expand = index.unsqueeze(-1).expand(-1, -1, d)
        keys = torch.gather(view.keys.reshape(segments, length, d), 1, expand)[pick]
        values = torch.gather(view.values.reshape(segments, length, d), 1, expand)[pick]
        positions = torch.gather(view.positions.reshape(segments, length), 1, index)[pick]
        return keys, values, positions

    def _gather_extras(self, view: DenseView, index: torch.Tensor, pick: torch.Tensor) -> dict[str, torch.Tensor]:
        """Side data of the picked entries, as :meth:`_gather` orders them."""
        segments, length = self.batch * self.heads, view.length
        out = {}
        for name, extra in view.extras.items():
            flat = extra.reshape(segments, length, *extra.shape[3:])
            expand = index.view(*index.shape, *([1] * (flat.dim() - 2))).expand(*index.shape, *flat.shape[2:])
            out[name] = torch.gather(flat, 1, expand)[pick]
        return out

    def add_dense(self, name: str, values: torch.Tensor) -> None:
        """Add ``(batch, heads, L, ...)`` values laid out like :meth:`dense` into side data ``name``: with tier
        entries, each slot's value goes where its entry lives (the full-precision store or a tier's slot)."""
        self.settle_deferred()
        if not self.tiered:
            super().add_dense(name, values)
            return
        view = self.dense()
        tier_of, slot_of = self._origins()
        valid = view.valid if view.valid is not None else torch.ones(tier_of.shape, dtype=torch.bool,
                                                                     device=tier_of.device)
        trailing = values.shape[3:]
        zero = torch.zeros((), dtype=values.dtype, device=values.device)

        def routed(number: int, width: int) -> torch.Tensor:
            mine = (valid & (tier_of == number)).view(*tier_of.shape, *([1] * len(trailing)))
            out = torch.zeros((*tier_of.shape[:2], width + 1, *trailing), dtype=values.dtype, device=values.device)
            slots = torch.where(tier_of == number, slot_of, width)  # others land in a spare last slot
            index = slots.view(*slots.shape, *([1] * len(trailing))).expand(*slots.shape, *trailing)
            return out.scatter_add(2, index, torch.where(mine, values, zero))[:, :, :width]

        super().add_dense(name, routed(0, self.max_length))  # the full-precision store's own view
        for number, tier in enumerate(self.tiers, start=1):
            if not tier.empty:
                tier.add_to_slots(name, routed(number, int(tier.groups_per_segment.max()) * tier.group))
        self._combined = None

    # ------------------------------------------------------------------ batch and snapshots
    def entries(self) -> dict[str, torch.Tensor]:
        """The full-precision entries (as the plain store saves them) and each tier's state as
        ``tier.<i>.<name>`` (packed codes, steps and minimums as held: nothing is dequantized to be saved)."""
        self.settle_deferred()
        out: dict[str, torch.Tensor] = super().entries()  # type: ignore[misc]
        for index, tier in enumerate(self.tiers):
            out.update({f"{TIER_PREFIX}{index}.{name}": tensor for name, tensor in tier.state().items()})
        return out

    def restore(self, entries: dict[str, torch.Tensor]) -> None:
        """Hold exactly ``entries`` (as :meth:`entries` returns them), tiers included; every part is checked
        before anything changes (``ValueError`` naming what does not fit)."""
        self.settle_deferred()
        tiers: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in entries.items():
            if key.startswith(TIER_PREFIX):
                number, _, name = key.removeprefix(TIER_PREFIX).partition(".")
                tiers.setdefault(int(number), {})[name] = tensor
        if sorted(tiers) != list(range(len(tiers))):
            raise ValueError(f"entries: tiers {sorted(tiers)} are not numbered 0…{len(tiers) - 1}")
        built = []
        for number in range(len(tiers)):
            bits, group, value_group = (int(x) for x in tiers[number]["config"].tolist())
            tier = QuantizedTier(self.batch, self.heads, self.head_dim, bits, group, value_group, self.dtype,
                                 self.device)
            for spec in self.side_specs.values():  # type: ignore[attr-defined]
                tier.ensure_side(spec)
            tier.load_state(tiers[number])
            built.append(tier)
        with self._one_layout_change():
            super().restore({k: v for k, v in entries.items()  # type: ignore[misc]
                             if not k.startswith(TIER_PREFIX)})
            self.tiers = built

    def select_batch(self, index: torch.Tensor) -> None:
        self.settle_deferred()
        with self._one_layout_change():
            super().select_batch(index)
            for tier in self.tiers:
                tier.select_batch(index)
