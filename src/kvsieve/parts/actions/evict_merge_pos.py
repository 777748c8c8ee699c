"""``ems_pos`` action — EMS "w. pos" (Li et al., 2024, arXiv:2412.08521, Table 1, Sec. 4.2 and App. A "Shared Entry
Expansion"): evict-then-merge exactly as :class:`~kvsieve.parts.actions.evict_merge.EvictThenMerge`, plus a
**position look-up table**: each entry remembers the positions of the tokens merged into it, and at
attention time a centre is expanded to one key per position it represents — its raw (un-rotated) merged
key re-rotated at each of them — all sharing its value.

Readings (the paper gives no code, and App. A only says the table is kept and the runtime cache is
"expanded to γN_imp tokens"):

* the table is per entry: side data ``ems_positions`` of ``table_width`` slots (int32, ``-1`` = empty;
  default ``⌈γ⌉ − 1``, so the runtime view is at most ``⌈γ⌉×`` the stored entries, the paper's
  "``N_imp`` tokens expanded to ``γN_imp``"); the entry's own position is its stored position;
* when more tokens were merged into an entry than its table holds, the most recent positions are kept
  (the paper evicts "one element from the look-up-table" without saying which) and each of the ``m``
  expanded copies of a centre of ``n`` tokens gets the bias ``log(n/m)``, so the centre still counts
  ``n`` times in the softmax (with a table that never overflows the bias is 0: every token attends at its
  own position);
* the expansion serves the attention *outputs*; the scorer's statistics (Global-Local rows) read the
  stored entries with the ``log n`` bias, as for ``ems``.

Extra memory: ``4·table_width`` bytes per entry (in ``nbytes``/``used_nbytes``; ``kv_nbytes`` unchanged),
and a transient ``(1 + table_width)×`` key/value view per layer while it attends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.store import LayerStore, SideSpec
from kvsieve.core.part import PolicyConfigError, is_int
from kvsieve.core.plan import Plan
from kvsieve.core.step import MERGE_COUNT, LayerStep
from kvsieve.ops.rope import rotary_table, rotate, unrotate
from kvsieve.parts.actions.evict_merge import EvictThenMerge

POSITION_TABLE = "ems_positions"


@dataclass(frozen=True)
class EvictThenMergePos(EvictThenMerge):
    """EMS w. pos: evict-then-merge plus a per-entry position table, expanded at attention time."""

    name: ClassVar[str] = "evict_merge_pos"
    table_width: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.table_width is None:
            if math.isinf(self.gamma):
                raise PolicyConfigError(f"{self.name}: table_width must be given (int ≥ 1) when gamma is inf")
        elif not is_int(self.table_width) or not 1 <= self.table_width <= 4096:
            raise PolicyConfigError(f"{self.name}: table_width must be an int in [1, 4096]; got {self.table_width!r}")

    @property
    def width(self) -> int:
        """Positions stored per entry besides its own."""
        return self.table_width if self.table_width is not None else max(math.ceil(self.gamma) - 1, 1)

    def side(self) -> tuple[SideSpec, ...]:
        return (*self.SIDE, SideSpec(POSITION_TABLE, (self.width,), torch.int32, -1.0))

    # ------------------------------------------------------------------ compaction
    def apply(self, store: LayerStore, plan: Plan) -> None:
        if not plan.merges:
            store.keep(plan.keep, plan.counts)
            return
        tables = merged_tables(store, plan, self.width)
        super().apply(store, plan)
        width = plan.keep.shape[1]
        valid = torch.arange(width)[None, :] < plan.counts[:, None]
        new_start = store.start  # where each segment's kept entries now begin
        rows = (new_start[:, None] + torch.arange(width)[None, :])[valid].to(store.device)
        store.write_rows(rows, extras={POSITION_TABLE: tables[valid.to(tables.device)]})

    # ------------------------------------------------------------------ attention
    def expanded(self, step: LayerStep) -> tuple[torch.Tensor, ...] | None:
        """Keys, values, positions, validity ``(batch, heads, L·(1 + W), ...)`` and the ``log(n/m)`` bias."""
        view = step.view
        if POSITION_TABLE not in view.extras:
            return None
        table = view.extras[POSITION_TABLE].long()
        positions = view.positions
        batch, heads, length, width = table.shape
        slots = torch.cat([positions[..., None], table], dim=-1)  # (B, H, L, 1 + W)
        valid = slots >= 0
        if view.valid is not None:
            valid = valid & view.valid[..., None]
        copies = valid.sum(dim=-1, keepdim=True).clamp(min=1)
        counts = view.extras[MERGE_COUNT].float().clamp(min=1.0)[..., None]
        bias = (counts / copies).log().expand_as(slots).masked_fill(~valid, 0.0)
        rot = rotary_table(step.module.config, step.layer_idx, view.keys.device)
        raw = unrotate(view.keys, positions, rot)
        at = slots.clamp(min=0)
        keys = rotate(raw[..., None, :].expand(*slots.shape, raw.shape[-1]), at, rot).to(view.keys.dtype)
        values = view.values[..., None, :].expand(*slots.shape, view.values.shape[-1])
        n = length * (1 + width)
        return (keys.reshape(batch, heads, n, -1), values.reshape(batch, heads, n, -1), at.reshape(batch, heads, n),
                valid.reshape(batch, heads, n), bias.reshape(batch, heads, n))


def merged_tables(store: LayerStore, plan: Plan, width: int) -> torch.Tensor:
    """Position tables ``(segments, K, width)`` of the kept entries after the plan's merges.

    Each kept entry's table gains the merged entries' own positions and their tables; the ``width`` most
    recent positions are kept (descending), ``-1`` fills the rest.
    """
    assert plan.merge_source is not None and plan.merge_target is not None
    device = store.keys.device
    segs, k = plan.keep.shape
    start = store.start.to(device)
    keep_rows = start[:, None] + plan.keep.to(device).clamp(max=max(store.keys.shape[0] - 1, 0))
    own = store.extras[POSITION_TABLE][keep_rows].long()  # (S, K, W)
    slot_ids = torch.arange(segs * k, device=device)
    cand_slot = [slot_ids[:, None].expand(-1, width).reshape(-1)]
    cand_pos = [own.reshape(-1)]
    source = plan.merge_source.to(device)
    active = source >= 0
    seg_of = torch.arange(segs, device=device)[:, None].expand_as(source)[active]
    src_rows = start[seg_of] + source[active]
    slot = seg_of * k + plan.merge_target.to(device)[active]
    cand_slot += [slot, slot[:, None].expand(-1, width).reshape(-1)]
    cand_pos += [store.positions[src_rows].long(), store.extras[POSITION_TABLE][src_rows].long().reshape(-1)]
    slots, pos = torch.cat(cand_slot), torch.cat(cand_pos)
    real = pos >= 0
    slots, pos = slots[real], pos[real]
    order = torch.argsort(slots * (1 << 40) - pos)  # by slot, then most recent first
    slots, pos = slots[order], pos[order]
    rank = torch.arange(slots.shape[0], device=device) - torch.searchsorted(slots, slots)
    fits = rank < width
    out = torch.full((segs * k, width), -1, dtype=torch.long, device=device)
    out[slots[fits], rank[fits]] = pos[fits]
    return out.view(segs, k, width).to(torch.int32)
