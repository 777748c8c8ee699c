"""``hsa`` selector — RocketKV's hybrid sparse attention (Behnam et al., 2025, arXiv:2502.14051,
Sec. 3.4, Algorithm 1, Sec. 3.6 for the budgets), the second stage of ``rocketkv`` / ``rocketkv_mt``.

Per decoding step and KV group (Algorithm 1; sums over the group so all its heads select the same):

1. ``i1`` = top-``k1`` dimensions of ``Σ_group |q|``; signs ``g = sign(Σ_group q[i1])``;
2. per page of ``s`` consecutive entries, ``P = Kmax[i1]`` where ``g ≥ 0`` else ``Kmin[i1]`` (only ``k1``
   elements read per page), approximate score ``s1 = (Σ_group q[i1]) · P`` (the group sum of the heads'
   scores — the bound is linear in ``q`` once the signs are fixed);
3. the top-``k2 = t/2`` tokens by their page's score (whole pages best first, the last one possibly in
   part) get exact attention.

Budgets (``k`` = token budget ``t`` per KV group, Sec. 3.6): with ``N₂`` entries held (after stage 1),
``c₂ = N₂ / t`` is the second stage's compression, split evenly between the sequence and head
dimensions: ``s = ⌈√c₂⌉`` and ``k1 = ⌊d·s / c₂⌋`` (at least 1), so the approximation reads
``(N₂/s)·k1 ≤ t·d`` elements = ``t/2`` tokens. ``N₂`` is what the layer holds at the first decoding step
after each prompt (after stage 1 evicted; the paper fixes them per input), unless ``page_size``/``k1``
are given. With ``filtered`` (RocketKV-MT) the pages and the top-``k2`` run over the *members* the
stage-1 filter marked (side datum ``stage1_keep``, :class:`~kvsieve.cache.member_pages.MemberPages`)
plus every entry appended since, while the store keeps everything.

**Selection, not eviction** (alone or in ``rocketkv_mt``): HSA deletes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.member_pages import STAGE1_KEEP, MemberPages
from kvsieve.cache.pages import PageMinMax
from kvsieve.cache.selection_state import SelectionState, hook_of, selected_nbytes, state_of
from kvsieve.cache.store import LayerStore, SideSpec, StoreHook
from kvsieve.core.part import require_bool, require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.parts.actions.mark import Mark
from kvsieve.parts.allocators.two_stage import TwoStageSplit
from kvsieve.parts.scorers.snapkv_plus import GroupWindowAttention
from kvsieve.parts.selectors.base import Selector
from kvsieve.parts.selectors.sparse import (
    grouped_query,
    page_valid,
    per_query_head,
    split_budget,
    top_tokens_of_pages,
)


def hsa_shape(held: int, budget: int, dim: int) -> tuple[int, int]:
    """``(page_size, k1)`` for ``held`` entries, token budget ``budget`` and head dimension ``dim`` (Sec. 3.6)."""
    ratio = max(held / budget, 1.0)
    page = math.ceil(math.sqrt(ratio) - 1e-9)
    return page, min(max(int(dim * page / ratio), 1), dim)


@dataclass(frozen=True)
class HybridSparse(Selector):
    """Hybrid (sequence × head dimension) top-k approximation, exact attention on ``t/2`` tokens."""

    name: ClassVar[str] = "hsa"
    #: Token budget ``t`` per KV group and decoding step (approximation + exact attention).
    k: int = 256
    #: Entries per page; 0: ``⌈√c₂⌉`` (Sec. 3.6).
    page_size: int = 0
    #: Head dimensions of the approximation; 0: ``⌊d·s/c₂⌋``.
    k1: int = 0
    #: RocketKV-MT: select only among the stage-1 members (side datum ``stage1_keep``).
    filtered: bool = False

    def validate(self) -> None:
        require_int(self.name, "k", self.k, 2)
        require_int(self.name, "page_size", self.page_size, 0)
        require_int(self.name, "k1", self.k1, 0)
        require_bool(self.name, "filtered", self.filtered)

    def side(self) -> tuple[SideSpec, ...]:
        """``stage1_keep`` when filtered: written by the ``mark`` action; with any other action every entry
        stays a member (the mark's fill is True), so ``hsa_mt`` selects among all held entries, as ``hsa``."""
        return (STAGE1_KEEP,) if self.filtered else ()

    def hooks(self) -> list[StoreHook]:
        pages: StoreHook = MemberPages(1, STAGE1_KEEP.name) if self.filtered else PageMinMax(1)
        return [SelectionState(), pages]

    def _shape(self, held: int, dim: int) -> dict[str, int]:
        page, k1 = hsa_shape(held, self.k, dim)
        return {"page_size": self.page_size or page, "k1": min(self.k1 or k1, dim)}

    def row_config(self, store: LayerStore) -> list[dict[str, int]] | None:
        pages = hook_of(store, MemberPages if self.filtered else PageMinMax)
        if isinstance(pages, MemberPages):  # the stage-1 members a row holds
            held = pages.count.view(store.batch, store.heads).amax(dim=1).cpu()
        else:
            held = store.lengths().amax(dim=1)
        return [self._shape(int(n), store.head_dim) for n in held.tolist()]

    def preset(self, store: LayerStore, config: dict[str, int]) -> None:
        pages = hook_of(store, MemberPages if self.filtered else PageMinMax)
        assert isinstance(pages, MemberPages | PageMinMax)
        pages.page_size = config["page_size"]
        pages.after_layout(store)
        state = state_of(store)
        state.config, state.dirty = dict(config), False

    def select(self, step: LayerStep) -> torch.Tensor | None:
        store, view = step.store, step.view
        state = state_of(store)
        if self.k >= view.length:
            state.record(store, store.kv_nbytes())
            return None
        pages = hook_of(store, MemberPages if self.filtered else PageMinMax)
        assert isinstance(pages, MemberPages | PageMinMax)
        if state.dirty:
            held = pages.max_count if isinstance(pages, MemberPages) else store.held_max_length
            page, k1 = hsa_shape(held, self.k, store.head_dim)
            page, k1 = self.page_size or page, min(self.k1 or k1, store.head_dim)
            if page != pages.page_size:
                pages.page_size = page
                pages.after_layout(store)
            state.config = {"page_size": page, "k1": k1}
            state.dirty = False
        k1 = state.config["k1"]
        query = grouped_query(step.query, store.heads)  # (b, kv, g, d)
        summed = query.sum(dim=2)  # (b, kv, d)
        dims = torch.topk(query.abs().sum(dim=2), k1, dim=-1).indices  # (b, kv, k1)
        q1 = summed.gather(-1, dims)  # (b, kv, k1)
        kmax, kmin = pages.view(store)
        held_pages = page_valid(kmax)
        slots = kmax.shape[2]
        at = dims[:, :, None, :].expand(-1, -1, slots, -1)
        chosen_stat = torch.where((q1 >= 0)[:, :, None, :], kmax.gather(-1, at), kmin.gather(-1, at)).float()
        chosen_stat = chosen_stat.masked_fill(~held_pages[..., None], 0.0)
        scores = torch.matmul(chosen_stat, q1[..., None])[..., 0].masked_fill(~held_pages, -math.inf)
        top = split_budget(self.k)
        if isinstance(pages, MemberPages):
            members, member_valid = pages.members(store)
            # a row holding fewer members than ``top`` (only in a padded batch) would repeat one: kept within count
            local = top_tokens_of_pages(scores, pages.page_size, members.shape[-1], top, member_valid)
            chosen = members.gather(-1, local)
        else:
            chosen = top_tokens_of_pages(scores, pages.page_size, view.length, top, view.valid)
        page_reads = held_pages.sum() * k1 * kmax.element_size()
        state.record(store, page_reads + selected_nbytes(store, chosen))
        return per_query_head(chosen, step.groups)


@dataclass(frozen=True)
class FilteredHybridSparse(HybridSparse):
    """HSA among the stage-1 members only (RocketKV-MT's second stage; ``filtered=True``)."""

    name: ClassVar[str] = "hsa_mt"
    filtered: bool = True


PRESETS = (
    Preset("hsa", "everything in memory; RocketKV's hybrid sparse attention (pages × top-k1 dims), token budget t "
           "(selection)", selector=HybridSparse()),
    Preset("rocketkv", "SnapKV++ keeps N/c^r (evicts), then hybrid sparse attention; token budget t",
           scorer=GroupWindowAttention(), allocator=TwoStageSplit(), selector=HybridSparse()),
    Preset("rocketkv_mt", "everything in memory; each turn SnapKV++ marks N/c^r, hybrid sparse attention among "
           "them; token budget t (selection)", scorer=GroupWindowAttention(), allocator=TwoStageSplit(),
           selector=FilteredHybridSparse(), action=Mark()),
)
