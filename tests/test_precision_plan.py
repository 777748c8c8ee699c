"""Group-aware mixed-precision planning (kvsieve.ops.precision_plan): byte bounds, whole groups, and the first
compaction's plan equal to "the best entries in the model dtype, the next ones in whole groups"."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.ops.precision_plan import group_aware_plan

G = 4


@st.composite
def layouts(draw):
    """A segment's entries: some in the model dtype, some in existing groups of one or two tiers, padding."""
    segments = draw(st.integers(1, 3))
    tiers = draw(st.integers(1, 2))
    length = draw(st.integers(2, 40))
    seed = draw(st.integers(0, 10**6))
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(segments, length, generator=generator)
    origin = torch.randint(0, tiers + 1, (segments, length), generator=generator)
    slot = torch.zeros(segments, length, dtype=torch.long)
    for s in range(segments):
        for t in range(1, tiers + 1):
            where = (origin[s] == t).nonzero().flatten()
            # existing groups hold 1..G live entries each, slots spread over the tier's own view
            gaps = torch.randint(0, 2, (len(where),), generator=generator)
            slot[s, where] = torch.cumsum(1 + gaps, 0) - 1
    padding = torch.rand(segments, length, generator=generator) < 0.1
    scores = scores.masked_fill(padding, -math.inf)
    protected = torch.rand(segments, length, generator=generator) < 0.1
    scores = scores.masked_fill(protected & (origin == 0) & ~padding, math.inf)
    full = torch.randint(0, length + 1, (segments,), generator=generator)
    full = torch.maximum(full, ((scores == math.inf).sum(dim=1)))
    groups = [torch.randint(0, 5, (segments,), generator=generator) for _ in range(tiers)]
    return scores, origin, slot, full, groups


@settings(max_examples=80, deadline=None, derandomize=True)
@given(layouts())
def test_every_head_stays_within_its_groups_and_keeps_groups_whole(layout):
    scores, origin, slot, full, groups = layout
    keep, target = group_aware_plan(scores, origin, slot, full, groups, G)
    valid = ~torch.isneginf(scores)
    assert not bool((keep & ~valid).any())  # padding is never kept
    for s in range(scores.shape[0]):
        stays = keep[s] & (origin[s] == 0) & (target[s] == 0)
        assert int(stays.sum()) <= int(full[s])
        assert bool(keep[s][scores[s] == math.inf].all())  # protected entries stay (full covers them)
        for t, allowed in enumerate(groups, start=1):
            mine = valid[s] & (origin[s] == t)
            kept_groups = set((slot[s][mine & keep[s]] // G).tolist())
            for g in set((slot[s][mine] // G).tolist()):  # an existing group is kept whole or evicted whole
                members = mine & (slot[s] // G == g)
                assert bool((keep[s][members]).all()) or not bool((keep[s][members]).any())
            demoted = int((keep[s] & (origin[s] == 0) & (target[s] == t)).sum())
            assert len(kept_groups) + math.ceil(demoted / G) <= int(allowed[s])
            assert bool((target[s][mine & keep[s]] == t).all())  # a quantized entry stays in its tier


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(0, 10**6), st.integers(5, 60), st.integers(0, 20), st.integers(0, 6))
def test_a_first_compaction_keeps_the_next_entries_in_score_order(seed, length, full, allowed):
    """No existing group: the ``full`` best entries stay, the next ``allowed·G`` (or all the rest) are quantized."""
    scores = torch.randn(2, length, generator=torch.Generator().manual_seed(seed))
    origin = torch.zeros(2, length, dtype=torch.long)
    slot = torch.arange(length).expand(2, -1)
    keep, target = group_aware_plan(scores, origin, slot, torch.tensor([full, full]),
                                    [torch.tensor([allowed, allowed])], G)
    for s in range(2):
        order = torch.argsort(scores[s], descending=True).tolist()
        stays = set(order[:full])
        low = set(order[full: full + allowed * G])
        assert set(keep[s].nonzero().flatten().tolist()) == stays | low
        assert set((target[s] == 1).nonzero().flatten().tolist()) == low


@settings(max_examples=120, deadline=None, derandomize=True)
@given(layouts(), st.booleans())
def test_the_first_compactions_one_sort_plans_what_the_general_path_plans(layout, ties):
    """``quantized=False`` (no tier holds an entry yet, the prefill's case) takes one sort instead of the general
    path's per-tier group sums; same ``keep`` and ``target``, padding, protected entries, two tiers and equal
    scores included."""
    scores, origin, slot, full, groups = layout
    origin = torch.zeros_like(origin)
    if ties:  # few distinct values: many equal scores across group edges
        finite = torch.isfinite(scores)
        scores = torch.where(finite, (scores * 2).round(), scores)
    general = group_aware_plan(scores, origin, slot, full, groups, G)
    first = group_aware_plan(scores, origin, slot, full, groups, G, quantized=False)
    assert torch.equal(first[0], general[0])
    assert torch.equal(first[1], general[1])
