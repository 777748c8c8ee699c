"""``quest`` selector (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv:2406.10774, Sec. 3.2–3.3), budgeted as RocketKV (Behnam et al., 2025, arXiv:2502.14051)
does (Sec. 3.6 and App. A.3).

Keys are grouped into pages of ``page_size`` consecutive held entries with element-wise ``Kmax``/``Kmin``
(:class:`~kvsieve.cache.pages.PageMinMax`, updated as tokens arrive). For each query head the page upper
bound is ``U = Σ_i max(q_i·Kmax_i, q_i·Kmin_i)`` (≥ every ``q·k`` of the page); GQA as RocketKV modifies
Quest: the heads' bounds are summed over the group and one selection serves the group. The best pages'
tokens (``k/2`` tokens, the last page possibly in part) get exact attention; the last (partial) page —
the newest tokens, the current one included — is always attended.

**Selection, not eviction**: nothing is deleted; memory is the full cache plus page min/max.

Budget reading (``k`` is the token budget ``t`` per KV group): half of ``t`` reads pages, half is
attended. Reading, per page and dimension, only the one of ``Kmax``/``Kmin`` the query's sign picks costs
``d`` elements per page, i.e. half a token, so ``N / s`` pages cost ``t/2`` tokens at ``s = ⌈N/t⌉ = ⌈c⌉``
— the page size that makes Quest's storage ``1 + 1/c`` (RocketKV Table 1). The page size is derived
from what the layer holds at the first decoding step after each prompt (``page_size=0``) or given.
Measured traffic counts, per group, page and dimension, ``Kmax`` if any head of the group has a positive
``q_i`` and ``Kmin`` if any has a negative one (heads of a group may need both), so it can exceed ``t``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.pages import PageMinMax
from kvsieve.cache.selection_state import SelectionState, hook_of, selected_nbytes, state_of
from kvsieve.cache.store import LayerStore, StoreHook
from kvsieve.core.part import require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.parts.selectors.base import Selector
from kvsieve.parts.selectors.sparse import (
    grouped_query,
    last_page_tokens,
    page_valid,
    per_query_head,
    split_budget,
    top_tokens_of_pages,
)


@dataclass(frozen=True)
class Quest(Selector):
    """Query-aware page selection by the per-page upper bound of ``q·k`` (selection, not eviction)."""

    name: ClassVar[str] = "quest"
    #: Token budget ``t`` per KV group and decoding step (approximation + exact attention).
    k: int = 256
    #: Entries per page; 0: ``⌈N / t⌉`` from the entries held at the first decoding step after a prompt.
    page_size: int = 0

    def validate(self) -> None:
        require_int(self.name, "k", self.k, 2)
        require_int(self.name, "page_size", self.page_size, 0)

    def hooks(self) -> list[StoreHook]:
        return [SelectionState(), PageMinMax(self.page_size or 1)]

    def configure(self, held: int) -> int:
        """Page size for ``held`` entries."""
        return self.page_size or max(math.ceil(held / self.k), 1)

    def row_config(self, store: LayerStore) -> list[dict[str, int]] | None:
        return [{"page_size": self.configure(int(n))} for n in store.lengths().amax(dim=1).tolist()]

    def preset(self, store: LayerStore, config: dict[str, int]) -> None:
        pages = hook_of(store, PageMinMax)
        assert isinstance(pages, PageMinMax)
        pages.page_size = config["page_size"]
        pages.after_layout(store)
        state_of(store).dirty = False

    def select(self, step: LayerStep) -> torch.Tensor | None:
        store, view = step.store, step.view
        length = view.length
        state = state_of(store)
        if self.k >= length:
            state.record(store, store.kv_nbytes())
            return None
        pages = hook_of(store, PageMinMax)
        assert isinstance(pages, PageMinMax)
        if state.dirty:
            size = self.configure(store.held_max_length)
            if size != pages.page_size:
                pages.page_size = size
                pages.after_layout(store)
            state.dirty = False
        size = pages.page_size
        kmax, kmin = pages.view(store)
        held_pages = page_valid(kmax)
        query = grouped_query(step.query, store.heads)  # (b, kv, g, d)
        bound = page_upper_bounds(query, kmax, kmin, held_pages).sum(dim=2)  # heads' bounds summed per group
        bound = bound.masked_fill(~held_pages, -math.inf)
        forced = last_page_tokens(step.lengths(), size, length)
        chosen = top_tokens_of_pages(bound, size, length, split_budget(self.k), view.valid, forced)
        # traffic: per group, page and dimension, Kmax if any head has q_i > 0, Kmin if any has q_i < 0
        per_page = (query > 0).any(dim=2).sum(dim=-1) + (query < 0).any(dim=2).sum(dim=-1)  # (b, kv)
        page_reads = (per_page * held_pages.sum(dim=-1)).sum() * kmax.element_size()
        state.record(store, page_reads + selected_nbytes(store, chosen))
        return per_query_head(chosen, step.groups)


def page_upper_bounds(
    query: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, held_pages: torch.Tensor
) -> torch.Tensor:
    """Quest's bound ``Σ_i max(q_i·Kmax_i, q_i·Kmin_i)`` ``(batch, kv_heads, n, slots)`` for queries
    ``(batch, kv_heads, n, d)`` and pages ``(batch, kv_heads, slots, d)``.

    ``max(q_i·Kmax_i, q_i·Kmin_i) = q_i⁺·Kmax_i + q_i⁻·Kmin_i`` (``Kmax ≥ Kmin``), so it is two matmuls;
    unused page slots (``±inf``) read as 0 and must be masked by the caller.
    """
    keep = held_pages[..., None]
    upper = kmax.masked_fill(~keep, 0.0).to(query.dtype)
    lower = kmin.masked_fill(~keep, 0.0).to(query.dtype)
    positive = query.clamp(min=0.0)
    return torch.matmul(positive, upper.transpose(-1, -2)) + torch.matmul(query - positive, lower.transpose(-1, -2))


PRESETS = (
    Preset("quest", "everything in memory; top pages by the q·k upper bound from page min/max, token budget t "
           "split evenly (selection)", selector=Quest()),
)
