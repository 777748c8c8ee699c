"""One layer's entries held at low precision: KIVI groups, real bit packing, ragged per (batch item, KV head).

Entries arrive per segment (``s = b·heads + h``) in position order and are cut into **groups** of ``G``
consecutive entries of one segment (the last group of an arrival may be partial: its free slots are
invalid). Within a group, keys are quantized **per channel** (one float16 step and minimum per channel
for the ``G`` tokens) and values **per token** (one step and minimum per ``value_group`` channels of each
token) — the recipe of KIVI (Liu et al., 2024, arXiv:2402.02750, Sec. 3.2–3.3), implemented in
:mod:`kvsieve.ops.quantize`. Codes are packed ``8 / bits`` to a byte.

Removing an entry marks its slot invalid; a group is freed when its last entry goes (the others keep the
step and minimum they were coded with, so nothing is re-quantized and no error accumulates). Groups are
kept segment by segment, so a segment's entries are a contiguous run of slots and the dense view is one
gather. Everything stays on the entries' device; segment bookkeeping is host ``long`` tensors.

Per-entry side data (a scorer's running statistic: H2O's accumulated attention, KVzip's reconstruction
score, retention gates) is kept per slot at its own precision (``extras``, ``(groups, G, ...)``), moves with
its entries and is updated in place (:meth:`add_to_slots`): only keys and values are quantized.
"""

from __future__ import annotations

import torch

from kvsieve.cache.side_data import SideSpec
from kvsieve.native.dequantize import dequantize_into
from kvsieve.native.quantize import quantize_groups
from kvsieve.ops.quantize import PARAM_DTYPE, asymmetric_codes, check_bits, code_table, pack, unpack_float

#: Prefix of a tier's side data in :meth:`QuantizedTier.state` (``extra.h2o_acc``).
EXTRA_PREFIX = "extra."


class QuantizedTier:
    """Entries of one layer at ``bits`` bits (see the module docstring)."""

    def __init__(self, batch: int, heads: int, head_dim: int, bits: int, group: int, value_group: int,
                 dtype: torch.dtype, device: torch.device):
        check_bits(bits)
        if group < 1:
            raise ValueError(f"group must be an int ≥ 1 (tokens per key group); got {group!r}")
        if value_group < 1 or head_dim % value_group:
            raise ValueError(f"value_group must divide head_dim={head_dim}; got {value_group!r}")
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.bits, self.group, self.value_group = bits, group, value_group
        self.dtype, self.device = dtype, device
        width = -(-head_dim * bits // 8)
        g = group
        self.key_codes = torch.empty((0, g, width), dtype=torch.uint8, device=device)
        self.value_codes = torch.empty((0, g, width), dtype=torch.uint8, device=device)
        self.key_params = torch.empty((0, 2, head_dim), dtype=PARAM_DTYPE, device=device)  # step, minimum
        self.value_params = torch.empty((0, g, 2, head_dim // value_group), dtype=PARAM_DTYPE, device=device)
        self.positions = torch.empty((0, g), dtype=torch.long, device=device)
        self.valid = torch.empty((0, g), dtype=torch.bool, device=device)
        #: Groups per segment (host), in segment order.
        self.groups_per_segment = torch.zeros(batch * heads, dtype=torch.long)
        #: Entries per segment (host).
        self.counts = torch.zeros(batch * heads, dtype=torch.long)
        #: Bumped by every change (views built from the tier compare it).
        self.version = 0
        #: Per-slot side data ``(groups, G, *shape)`` and its specs (see the module docstring).
        self.extras: dict[str, torch.Tensor] = {}
        self.side_specs: dict[str, SideSpec] = {}
        self._table: torch.Tensor | None = None
        self._layout: tuple[int, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None = None

    # ------------------------------------------------------------------ size
    @property
    def segments(self) -> int:
        return self.batch * self.heads

    def lengths(self) -> torch.Tensor:
        """Entries held per (batch item, KV head) ``(batch, heads)`` (host tensor)."""
        return self.counts.view(self.batch, self.heads).clone()

    @property
    def empty(self) -> bool:
        return self.key_codes.shape[0] == 0

    def kv_nbytes(self) -> int:
        """Bytes of keys and values held: packed codes, steps and minimums (free slots of partial groups too)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.key_codes, self.value_codes, self.key_params, self.value_params))

    def ensure_side(self, spec: SideSpec) -> None:
        """Keep side data ``spec.name`` per slot (filled with ``spec.fill``) if not kept yet."""
        if spec.name in self.extras:
            return
        self.side_specs[spec.name] = spec
        self.extras[spec.name] = torch.full((self.key_codes.shape[0], self.group, *spec.shape), spec.fill,
                                            dtype=spec.dtype, device=self.device)

    def group_nbytes(self, values_only: bool = False) -> int:
        """Key and value bytes one group holds: packed codes, steps and minimums (whatever its live entries);
        ``values_only``: the values' alone."""
        buffers = (self.value_codes, self.value_params) if values_only else (
            self.key_codes, self.value_codes, self.key_params, self.value_params)
        return sum(_row_numel(t) * t.element_size() for t in buffers)

    def segment_kv_nbytes(self) -> torch.Tensor:
        """Key and value bytes held per segment ``(segments,)`` (host): its groups × :meth:`group_nbytes`."""
        return self.groups_per_segment * self.group_nbytes()

    def nbytes(self) -> int:
        """All bytes held, positions, slot validity and side data included."""
        extras = sum(t.numel() * t.element_size() for t in self.extras.values())
        return self.kv_nbytes() + self.positions.numel() * 8 + self.valid.numel() + extras

    # ------------------------------------------------------------------ adding entries
    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor,
            extras: dict[str, torch.Tensor] | None = None, native: bool = True) -> None:
        """Quantize and add entries: ``keys``/``values`` ``(n, d)``, ``positions`` ``(n,)``, grouped by segment
        in segment order, ``counts`` (host ``(segments,)``) entries of each segment, in position order;
        ``extras`` their side data ``(n, ...)`` (a field not given starts at its fill). ``native``: on the CPU the
        codes are made by kvsieve's C pass where it is built (:mod:`kvsieve.native.quantize`, bit for bit the
        PyTorch path below; False keeps the PyTorch path, the reference the tests compare it with)."""
        counts = counts.to(torch.long).cpu()
        if int(counts.sum()) != keys.shape[0]:
            raise ValueError(f"counts sum to {int(counts.sum())} entries; got {keys.shape[0]}")
        g = self.group
        new_groups = -(-counts // g)
        total = int(new_groups.sum())
        if total == 0:
            return
        seg_of_entry = torch.repeat_interleave(torch.arange(self.segments), counts)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(keys.shape[0]) - first[seg_of_entry]
        group_first = torch.cumsum(new_groups, 0) - new_groups
        slot = (group_first[seg_of_entry] * g + rank).to(self.device)
        d = self.head_dim
        padded_k = torch.zeros((total * g, d), dtype=torch.float32, device=self.device)
        padded_v = torch.zeros((total * g, d), dtype=torch.float32, device=self.device)
        pos = torch.zeros(total * g, dtype=torch.long, device=self.device)
        valid = torch.zeros(total * g, dtype=torch.bool, device=self.device)
        padded_k[slot], padded_v[slot], pos[slot], valid[slot] = keys.float(), values.float(), positions, True
        coded = quantize_groups(self.bits, g, self.value_group, padded_k.view(total, g, d),
                                padded_v.view(total, g, d), valid.view(total, g)) if native else None
        if coded is not None:  # the CPU's C pass: the same codes and parameters bit for bit
            key_codes, key_params, value_codes, value_params = coded
        else:
            key_codes, key_params = self._quantize_keys(padded_k.view(total, g, d), valid.view(total, g))
            value_codes, value_params = self._quantize_values(padded_v)
        side = []
        for name, spec in self.side_specs.items():
            padded = torch.full((total * g, *spec.shape), spec.fill, dtype=spec.dtype, device=self.device)
            if extras is not None and name in extras:
                padded[slot] = extras[name].to(spec.dtype)
            side.append(padded.view(total, g, *spec.shape))
        self.counts = self.counts + counts
        self.version += 1
        self._insert(new_groups, key_codes, value_codes.view(total, g, -1), key_params,
                     value_params.view(total, g, 2, -1), pos.view(total, g), valid.view(total, g), *side)

    def _quantize_keys(self, keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel codes over each group's valid slots: ``(groups, G, width)`` and params ``(groups, 2, d)``."""
        inf = torch.tensor(float("inf"), device=keys.device)
        mask = valid.unsqueeze(-1)
        low = torch.where(mask, keys, inf).amin(dim=1, keepdim=True)
        high = torch.where(mask, keys, -inf).amax(dim=1, keepdim=True)
        codes, step, low16 = asymmetric_codes(keys, low, high, self.bits)
        params = torch.cat([step, low16], dim=1).to(PARAM_DTYPE)
        return pack(codes * mask, self.bits), params

    def _quantize_values(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token codes ``(n, width)`` and params ``(n, 2, d / value_group)`` (free slots are zeros)."""
        n, d = values.shape
        grouped = values.view(n, d // self.value_group, self.value_group)
        low, high = grouped.amin(dim=2, keepdim=True), grouped.amax(dim=2, keepdim=True)
        codes, step, low16 = asymmetric_codes(grouped, low, high, self.bits)
        params = torch.stack([step.squeeze(2), low16.squeeze(2)], dim=1).to(PARAM_DTYPE)
        return pack(codes.view(n, d), self.bits), params

    def _insert(self, new_groups: torch.Tensor, *tensors: torch.Tensor) -> None:
        """Place new groups after each segment's existing ones (segment order kept)."""
        old_groups = self.groups_per_segment
        segment_old = torch.repeat_interleave(torch.arange(self.segments), old_groups)
        segment_new = torch.repeat_interleave(torch.arange(self.segments), new_groups)
        order = torch.sort(torch.cat([segment_old, segment_new]), stable=True).indices.to(self.device)
        for name, new in zip(_BUFFERS, tensors[: len(_BUFFERS)], strict=True):
            setattr(self, name, torch.cat([getattr(self, name), new]).index_select(0, order))
        for name, new in zip(self.side_specs, tensors[len(_BUFFERS):], strict=True):
            self.extras[name] = torch.cat([self.extras[name], new]).index_select(0, order)
        self.groups_per_segment = old_groups + new_groups

    # ------------------------------------------------------------------ reading
    def dequantized(self, groups: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                    native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every slot ``(groups, G, d)`` in the model dtype (free slots hold garbage):
        ``code·step + minimum`` computed in float32 (one lookup for the codes, one fused multiply-add).

        ``groups``: an index of the groups to dequantize, in that order (repeats allowed): the packed codes and
        their steps and minimums are gathered first, so only those groups are expanded (the same numbers as
        gathering the dequantized groups, from ``bits/16`` of the bytes moved).

        ``out``: tensors to write the keys and values into (any strides; as many elements as the result, e.g. a
        slice of a larger attention view), rounded to their dtype as ``.to`` rounds: the caller's view then needs no
        second copy of the dequantized entries.

        ``native``: on the CPU, write the result with kvsieve's C pass (:mod:`kvsieve.native.dequantize`: the same
        numbers bit for bit, one pass instead of about ten operations) when it is built; False keeps the PyTorch
        path below (the reference the tests compare the C pass with)."""
        g, d = self.group, self.head_dim
        if native and self.device.type == "cpu" and self.key_codes.shape[0]:
            if out is None:
                count = self.key_codes.shape[0] if groups is None else groups.numel()
                shape = (1, 1, count * g, d)
                result = (torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))
            else:
                result = out
            if dequantize_into(self.bits, g, self.value_group, self.key_codes, self.key_params, self.value_codes,
                               self.value_params, groups, *result):
                return out if out is not None else (result[0].view(count, g, d), result[1].view(count, g, d))
        if self._table is None:
            self._table = code_table(self.bits, self.device)
        key_codes, key_params = self.key_codes, self.key_params
        value_codes, value_params = self.value_codes, self.value_params
        if groups is not None:
            key_codes, key_params = key_codes.index_select(0, groups), key_params.index_select(0, groups)
            value_codes, value_params = value_codes.index_select(0, groups), value_params.index_select(0, groups)
        count = key_codes.shape[0]
        key_params = key_params.float()
        keys = torch.addcmul(key_params[:, 1:2], unpack_float(key_codes, self._table, d), key_params[:, 0:1])
        value_floats = unpack_float(value_codes, self._table, d).view(count, g, d // self.value_group,
                                                                      self.value_group)
        params = value_params.float()
        values = torch.addcmul(params[:, :, 1, :, None], value_floats, params[:, :, 0, :, None])
        if out is not None:
            out[0].copy_(keys.view(out[0].shape))
            out[1].copy_(values.view(out[1].shape))
            return out
        return keys.to(self.dtype), values.reshape(count, g, d).to(self.dtype)

    def attention_layout(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The slot layout :meth:`attention_parts` reads, ``(group index, positions, valid)``: kept until the tier
        changes (positions ``(batch, heads, slots)`` give the number of slots)."""
        layout = self._layout
        if layout is None or layout[0] != self.version:
            layout = self._layout = (self.version, *self._slot_layout())
        return layout[1], layout[2], layout[3]

    def attention_parts(self, out: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`dense`'s ``(keys, values, positions, valid)`` for attention, with ``valid`` None when every slot
        holds an entry. The slot layout (and the positions) are kept until the tier changes, so a decoding step
        only dequantizes — and, when heads hold different numbers of groups, the groups of the padded layout
        are gathered packed, before dequantizing (:meth:`dequantized`). ``out``: ``(batch, heads, slots, d)``
        tensors (slices of the caller's view) the keys and values are written into."""
        index, positions, valid = self.attention_layout()
        keys, values = self.dequantized(index, out)
        if out is None:
            shape = (self.batch, self.heads, positions.shape[2], self.head_dim)
            keys, values = keys.view(shape), values.view(shape)
        return keys, values, positions, valid

    def _slot_layout(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Group gather index (None when every segment holds as many groups), padded positions, and slot
        validity (None when full) of the :meth:`dense` layout; decided from host bookkeeping, no device read."""
        g, per_segment = self.group, self.groups_per_segment
        most = int(per_segment.max()) if self.segments else 0
        shape = (self.batch, self.heads, most * g)
        if bool((per_segment == most).all()):
            full = bool((self.counts == most * g).all())
            return None, self.positions.view(shape), None if full else self.valid.view(shape)
        first = torch.cumsum(per_segment, 0) - per_segment
        offs = torch.arange(most)
        present = (offs[None, :] < per_segment[:, None]).to(self.device)
        index = (first[:, None] + offs[None, :]).clamp(max=max(self.key_codes.shape[0] - 1, 0)).reshape(-1)
        index = index.to(self.device)
        positions = self.positions.index_select(0, index).view(shape)
        valid = (self.valid.index_select(0, index).view(self.segments, most, g) & present.unsqueeze(-1)).view(shape)
        return index, positions, valid

    def dense_extras(self) -> dict[str, torch.Tensor]:
        """Side data in the :meth:`dense` layout, ``(batch, heads, slots, ...)`` per field."""
        layout = self._layout
        if layout is None or layout[0] != self.version:
            layout = self._layout = (self.version, *self._slot_layout())
        index, positions = layout[1], layout[2]
        out = {}
        for name, extra in self.extras.items():
            picked = extra if index is None else extra.index_select(0, index)
            out[name] = picked.reshape(*positions.shape, *extra.shape[2:])
        return out

    def add_to_slots(self, name: str, values: torch.Tensor) -> None:
        """Add ``values`` ``(batch, heads, slots, ...)`` (the :meth:`dense` layout) into side data ``name``."""
        g = self.group
        most = int(self.groups_per_segment.max()) if self.segments else 0
        target = self.extras[name]
        # the layout's present groups, from host bookkeeping (an index, not a boolean mask: no device read)
        present = torch.arange(most)[None, :] < self.groups_per_segment[:, None]
        rows = (torch.arange(self.segments)[:, None] * most + torch.arange(most)[None, :])[present].to(self.device)
        grouped = values.reshape(self.segments * most, g, *target.shape[2:]).index_select(0, rows)
        target += grouped.to(target.dtype)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, positions, valid)`` padded to ``(batch, heads, slots, ...)``: each segment's groups'
        slots in order (slots, not entries: a removed entry leaves an invalid slot)."""
        keys, values, positions, valid = self.attention_parts()
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=self.device)
        return keys, values, positions, valid

    # ------------------------------------------------------------------ removing entries
    def keep(self, keep: torch.Tensor) -> None:
        """Keep the slots where ``keep`` ``(batch, heads, slots)`` (the :meth:`dense` layout) is True; groups
        left without an entry are freed."""
        g = self.group
        most = int(self.groups_per_segment.max()) if self.segments else 0
        if keep.shape != (self.batch, self.heads, most * g):
            raise ValueError(f"keep must have shape {(self.batch, self.heads, most * g)}; got {tuple(keep.shape)}")
        present = torch.arange(most)[None, :] < self.groups_per_segment[:, None]
        flat_keep = keep.reshape(self.segments, most, g)[present.to(keep.device)]
        self.valid = self.valid & flat_keep
        self.version += 1
        per_group = self.valid.sum(dim=1).cpu()  # one host read per compaction
        segment = torch.repeat_interleave(torch.arange(self.segments), self.groups_per_segment)
        self.counts = torch.zeros(self.segments, dtype=torch.long).index_add_(0, segment, per_group)
        alive_host = per_group > 0
        self.groups_per_segment = torch.bincount(segment[alive_host], minlength=self.segments)
        alive = alive_host.to(self.device)
        for name in _BUFFERS:
            setattr(self, name, getattr(self, name)[alive])
        self.extras = {name: extra[alive] for name, extra in self.extras.items()}

    # ------------------------------------------------------------------ saving
    def state(self) -> dict[str, torch.Tensor]:
        """Everything the tier holds, for a saved context: its buffers (codes, steps and minimums, positions,
        slot validity), the per-segment counts and ``config`` = ``(bits, group, value_group)``."""
        out = {name: getattr(self, name) for name in _BUFFERS}
        out.update({EXTRA_PREFIX + name: extra for name, extra in self.extras.items()})
        out["groups_per_segment"] = self.groups_per_segment.clone()
        out["counts"] = self.counts.clone()
        out["config"] = torch.tensor([self.bits, self.group, self.value_group])
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Hold exactly what :meth:`state` returned (checked against this tier's shape first; a mismatch raises
        ``ValueError`` and changes nothing)."""
        config = [int(x) for x in state["config"].tolist()]
        if config != [self.bits, self.group, self.value_group]:
            raise ValueError(f"tier saved as (bits, group, value_group) {tuple(config)}; this tier is "
                             f"{(self.bits, self.group, self.value_group)}")
        groups = state["groups_per_segment"].to(torch.long).cpu()
        total = int(groups.sum())
        expected = {name: (total, *getattr(self, name).shape[1:]) for name in _BUFFERS}
        if groups.numel() != self.segments:
            raise ValueError(f"tier: saved for {groups.numel()} segments; this store has {self.segments}")
        for name, shape in expected.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"tier: {name} {tuple(state[name].shape)}, expected {shape} for {total} groups "
                                 f"at (bits, group, value_group) = {tuple(config)}, head size {self.head_dim}")
        saved_sides = {key.removeprefix(EXTRA_PREFIX) for key in state if key.startswith(EXTRA_PREFIX)}
        if saved_sides != set(self.side_specs):
            raise ValueError(f"tier: saved with side data {sorted(saved_sides)}; this tier keeps "
                             f"{sorted(self.side_specs)}")
        for name, spec in self.side_specs.items():
            if tuple(state[EXTRA_PREFIX + name].shape) != (total, self.group, *spec.shape):
                raise ValueError(f"tier: side data {name} {tuple(state[EXTRA_PREFIX + name].shape)}, expected "
                                 f"{(total, self.group, *spec.shape)}")
        for name in _BUFFERS:
            setattr(self, name, state[name].to(device=self.device, dtype=getattr(self, name).dtype).contiguous())
        self.extras = {name: state[EXTRA_PREFIX + name].to(device=self.device, dtype=spec.dtype).contiguous()
                       for name, spec in self.side_specs.items()}
        self.groups_per_segment = groups.clone()
        self.counts = state["counts"].to(torch.long).cpu().clone()
        self.version += 1

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder / select batch items (beam search, batch filtering), as the full-precision store does."""
        index = index.cpu()
        self.version += 1
        segs = (index[:, None] * self.heads + torch.arange(self.heads)[None, :]).reshape(-1)
        first = torch.cumsum(self.groups_per_segment, 0) - self.groups_per_segment
        groups = self.groups_per_segment[segs]
        rows = torch.cat([torch.arange(int(f), int(f) + int(g)) for f, g in zip(first[segs], groups, strict=True)]
                         ) if len(segs) else torch.zeros(0, dtype=torch.long)
        rows = rows.to(torch.long).to(self.device)
        for name in _BUFFERS:
            setattr(self, name, getattr(self, name).index_select(0, rows))
        self.extras = {name: extra.index_select(0, rows) for name, extra in self.extras.items()}
        self.batch = len(index)
        self.groups_per_segment, self.counts = groups.clone(), self.counts[segs].clone()


_BUFFERS = ("key_codes", "value_codes", "key_params", "value_params", "positions", "valid")


def _row_numel(t: torch.Tensor) -> int:
    """Elements of one row (group) of a buffer ``(groups, ...)``, also when it holds no group."""
    count = 1
    for size in t.shape[1:]:
        count *= size
    return count
