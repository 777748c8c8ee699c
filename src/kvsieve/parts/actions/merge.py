"""``merge`` action: keep the top entries and fold planned others into them instead of dropping them.

This is the hook evict-then-merge methods fill (EMS, ``papers/ems.txt`` Sec. 4.2): subclasses decide,
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
from kvsieve.engine.plan import Plan
from kvsieve.engine.step import MERGE_COUNT, LayerStep
from kvsieve.parts.actions.base import Action
from kvsieve.scores.rope import RotaryTable, rotate, unrotate

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
        merged = merge_kept(store, plan)
        store.keep(plan.keep, plan.counts)
        new_start = torch.cumsum(plan.counts, 0) - plan.counts
        width = plan.keep.shape[1]
        valid = torch.arange(width)[None, :] < plan.counts[:, None]
        rows = (new_start[:, None] + torch.arange(width)[None, :])[valid].to(store.device)
        keys, values, counts = merged
        store.write_rows(rows, keys[valid.to(keys.device)], values[valid.to(keys.device)],
                         {MERGE_COUNT: counts[valid.to(keys.device)]})


def merge_kept(store: LayerStore, plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged keys, values ``(segments, K, d)`` and counts ``(segments, K)`` of the kept entries (float32)."""
    assert plan.merge_source is not None and plan.merge_target is not None and plan.merge_weight is not None
    device = store.keys.device
    segs, width = plan.keep.shape
    start = store.start.to(device)
    keep_rows = (start[:, None] + plan.keep.to(device).clamp(max=max(store.keys.shape[0] - 1, 0)))
    rotary: RotaryTable | None = getattr(plan, "rotary", None)
    keys = store.keys[keep_rows].float()
    if rotary is not None:
        stored_keys, keep_positions = keys, store.positions[keep_rows]
        keys = unrotate(keys, keep_positions, rotary)
    values = store.values[keep_rows].float()
    counts = store.extras[MERGE_COUNT][keep_rows].float() if MERGE_COUNT in store.extras else torch.ones(
        segs, width, device=device)
    own = plan.keep_weight.to(device).float() if plan.keep_weight is not None else counts.clone()
    norms = keys.norm(dim=-1, keepdim=True)
    direction_sum = own[..., None] * keys / norms.clamp(min=EPS)
    norm_sum = own[..., None] * norms
    value_sum = own[..., None] * values
    weight_sum = own.clone()
    count_sum = counts.clone()
    source = plan.merge_source.to(device)
    active = source >= 0
    if bool(active.any()):
        seg_of = torch.arange(segs, device=device)[:, None].expand_as(source)[active]
        src_rows = start[seg_of] + source[active]
        slot = seg_of * width + plan.merge_target.to(device)[active]
        w = plan.merge_weight.to(device).float()[active]
        src_keys = store.keys[src_rows].float()
        if rotary is not None:
            src_keys = unrotate(src_keys, store.positions[src_rows], rotary)
        src_norms = src_keys.norm(dim=-1, keepdim=True)
        src_counts = store.extras[MERGE_COUNT][src_rows].float() if MERGE_COUNT in store.extras else torch.ones_like(w)
        d = keys.shape[-1]
        direction_sum.view(-1, d).index_add_(0, slot, w[:, None] * src_keys / src_norms.clamp(min=EPS))
        norm_sum.view(-1, 1).index_add_(0, slot, w[:, None] * src_norms)
        value_sum.view(-1, d).index_add_(0, slot, w[:, None] * store.values[src_rows].float())
        weight_sum.view(-1).index_add_(0, slot, w)
        count_sum.view(-1).index_add_(0, slot, src_counts)
    total = weight_sum.clamp(min=EPS)[..., None]
    direction = direction_sum / direction_sum.norm(dim=-1, keepdim=True).clamp(min=EPS)
    merged_keys = direction * (norm_sum / total)
    merged_values = value_sum / total
    if rotary is not None:
        merged_keys, keys = rotate(merged_keys, keep_positions, rotary), stored_keys
    untouched = (weight_sum == own)[..., None]  # nothing merged in: keep the exact original bits
    merged_keys = torch.where(untouched, keys, merged_keys)
    merged_values = torch.where(untouched, values, merged_values)
    return merged_keys, merged_values, count_sum
