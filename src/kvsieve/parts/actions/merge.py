"""``merge`` action: keep the top entries and fold planned others into them instead of dropping them.

This is the hook evict-then-merge methods fill (EMS, Li et al., 2024, arXiv:2412.08521, Sec. 4.2): subclasses decide,
in :meth:`Merge.assign`, which dropped entries go into which kept entry and with what weight; this class
executes any such plan exactly:

* every kept entry carries ``merge_count`` (side data, starts at 1): how many tokens it stands for;
  every attention path adds ``log(merge_count)`` to its logit, so an entry standing for ``n`` tokens
  counts ``n`` times in the softmax (the engine's bias);
* values are merged as the weighted mean ``(w_c v_c + Σ_i w_i v_i) / (w_c + Σ_i w_i)``;
* keys are merged as directions with the norm kept apart: the weighted mean of the unit directions,
  renormalised, times the weighted mean of the norms — so merging copies of a key returns that key;
* ``w_c`` defaults to the kept entry's own count; ``w_i`` comes from the plan (e.g. attention scores);
* a plan carrying a ``rotary`` table (:class:`RawKeyPlan`, EMS) merges keys in raw (pre-RoPE) space: every
  key involved is un-rotated at its stored position, merged, and the result re-rotated at the receiving
  entry's position (which it keeps).

The base class assigns nothing (it behaves exactly like eviction but keeps counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.store import LayerStore, SideSpec
from kvsieve.core.plan import Plan
from kvsieve.core.step import MERGE_COUNT, LayerStep
from kvsieve.ops.rope import RotaryTable, rotate, unrotate
from kvsieve.parts.actions.base import Action

EPS = 1e-12


@dataclass
class RawKeyPlan(Plan):
    """A plan whose key merges happen on raw keys, un-rotated with the layer's rotary table."""

    rotary: RotaryTable | None = None


@dataclass(frozen=True)
class Merge(Action):
    """Evict-then-merge executor; :meth:`assign` (no merges here) is the method-specific part."""

    name: ClassVar[str] = "merge"
    SIDE: ClassVar[tuple[SideSpec, ...]] = (SideSpec(MERGE_COUNT, (), torch.float32, 1.0),)

    def plan(self, scores: torch.Tensor, counts: torch.Tensor, step: LayerStep) -> Plan:
        plan = super().plan(scores, counts, step)
        self.assign(plan, scores, step)
        return plan

    def assign(self, plan: Plan, scores: torch.Tensor, step: LayerStep) -> None:
        """Fill ``plan.merge_source/target/weight`` (and optionally ``keep_weight``); default: merge nothing."""

    def apply(self, store: LayerStore, plan: Plan) -> None:
        if not plan.merges:
            store.keep(plan.keep, plan.counts)
            return
        merged = merge_kept(store, plan)  # reads the receiving entries before the compaction moves them
        store.keep(plan.keep, plan.counts)
        new_start = store.start.to(store.device)  # where each segment's kept entries now begin
        rows = new_start[merged.segments] + merged.ranks
        store.write_rows(rows, merged.keys, merged.values, {MERGE_COUNT: merged.counts})


@dataclass
class MergedRows:
    """The receiving entries of a plan's merges, one row per merged (source) entry — a receiving entry
    that takes ``m`` entries appears ``m`` times with the same result (index writes of equal values).

    Attributes:
        segments: ``(M,)`` segment of each row; ``ranks``: ``(M,)`` its rank in the plan's ``keep``.
        keys, values: ``(M, d)`` merged key (rotated as stored) and value, float32.
        counts: ``(M,)`` tokens the receiving entry stands for after the merge.
    """

    segments: torch.Tensor
    ranks: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor


def merge_kept(store: LayerStore, plan: Plan) -> MergedRows:
    """Merge each planned source into its receiving kept entry; only the receiving entries are computed.

    Per receiving entry ``c`` with own weight ``w_c`` and sources ``i`` (weights ``w_i``): key
    ``normalize(w_c k̂_c + Σ w_i k̂_i) · (w_c‖k_c‖ + Σ w_i‖k_i‖)/(w_c + Σ w_i)`` (``k̂`` unit, raw space
    for a :class:`RawKeyPlan`), value ``(w_c v_c + Σ w_i v_i)/(w_c + Σ w_i)``, count ``n_c + Σ n_i``.
    Entries that receive nothing are not read or rewritten (their bits stay), so the cost scales with the
    merges, not with the budget: at a decoding step that merges one entry per head, a few rows.
    """
    assert plan.merge_source is not None and plan.merge_target is not None and plan.merge_weight is not None
    device = store.keys.device
    segs, width = plan.keep.shape
    start = store.start.to(device)
    rotary: RotaryTable | None = getattr(plan, "rotary", None)
    source = plan.merge_source.to(device)
    active = source >= 0
    seg_of = torch.arange(segs, device=device)[:, None].expand_as(source)[active]
    rank = plan.merge_target.to(device)[active]
    w = plan.merge_weight.to(device).float()[active]
    n = seg_of.shape[0]
    slot = seg_of * width + rank
    # each receiving entry's own contribution is added once: at the first source row naming its slot
    first = torch.full((segs * width,), n, dtype=torch.long, device=device)
    first.scatter_reduce_(0, slot, torch.arange(n, device=device), reduce="amin")
    once = (first[slot] == torch.arange(n, device=device)).float()

    def read(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        stored = store.keys[rows].float()
        keys = unrotate(stored, store.positions[rows], rotary) if rotary is not None else stored
        counts = store.extras[MERGE_COUNT][rows].float() if MERGE_COUNT in store.extras else torch.ones(
            rows.shape[0], device=device)
        return stored, keys, store.values[rows].float(), counts

    centre_rows = start[seg_of] + plan.keep.to(device)[seg_of, rank]
    centre_stored, centre_keys, centre_values, centre_counts = read(centre_rows)
    own = plan.keep_weight.to(device).float()[seg_of, rank] if plan.keep_weight is not None else centre_counts
    _, src_keys, src_values, src_counts = read(start[seg_of] + source[active])
    centre_norms = centre_keys.norm(dim=-1, keepdim=True)
    src_norms = src_keys.norm(dim=-1, keepdim=True)
    c = (own * once)[:, None]
    wi = w[:, None]

    def per_slot(terms: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(segs * width, terms.shape[-1], device=device, dtype=terms.dtype)
        return total.index_add_(0, slot, terms)[slot]

    direction = per_slot(c * centre_keys / centre_norms.clamp(min=EPS) + wi * src_keys / src_norms.clamp(min=EPS))
    sums = per_slot(torch.cat([c * centre_norms + wi * src_norms, c + wi,
                               (centre_counts * once + src_counts)[:, None]], dim=-1))
    norm_sum, weight_sum, count_sum = sums.unbind(-1)
    total = weight_sum.clamp(min=EPS)[:, None]
    keys = direction / direction.norm(dim=-1, keepdim=True).clamp(min=EPS) * (norm_sum[:, None] / total)
    values = per_slot(c * centre_values + wi * src_values) / total
    if rotary is not None:
        keys = rotate(keys, store.positions[centre_rows], rotary)
    untouched = (weight_sum == own)[:, None]  # merged weights below the float resolution: keep the exact bits
    keys = torch.where(untouched, centre_stored, keys)
    values = torch.where(untouched, centre_values, values)
    return MergedRows(seg_of, rank, keys, values, count_sum)
