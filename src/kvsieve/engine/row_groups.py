"""Decoding-time selection row by row: each batch row gets the configuration it would get alone.

Quest's page size, SparQ's ``r`` and HSA's page size and ``k1`` are derived from what a store holds at the
first decoding step after a prompt; a store holds every row of a batch, so the longest row would set them
for all. :func:`select_by_row` records each row's own configuration (:meth:`Selector.row_config`) at that
step; while every row that is selecting at all (rows holding ≤ ``t`` entries attend to everything, decided
in the engine) shares one configuration, the selector runs once on the whole store, as before. Otherwise
it runs once per group of rows with the same configuration, on a copy of the store restricted to those
rows with that configuration installed (:meth:`Selector.preset`), and the subsets are put back together.
The copy gathers the group's entries once per decoding step and layer: mixed batches pay roughly what
full attention would read, in exchange for each row answering as it would alone.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from kvsieve.cache.selection_state import SelectionState
from kvsieve.cache.store import LayerStore
from kvsieve.core.selection import Selection
from kvsieve.core.step import LayerStep
from kvsieve.parts.selectors.base import Selector


def _state(step: LayerStep) -> SelectionState | None:
    return next((hook for hook in step.store.hooks if isinstance(hook, SelectionState)), None)


def _restricted(store: LayerStore, rows: list[int]) -> LayerStore:
    """The store's ``rows`` alone. ``select_batch`` gathers new tensors and every hook rebuilds (reassigns)
    its data in ``after_layout``, so shallow copies of the store and its hooks leave the original intact
    and copy only the group's entries."""
    restricted = copy.copy(store)
    restricted.hooks = [copy.copy(hook) for hook in store.hooks]
    restricted.tiers = [copy.copy(tier) for tier in store.tiers]  # their select_batch reassigns, as the store's
    restricted.select_batch(torch.tensor(rows))
    return restricted


def _rows_of(step: LayerStep, rows: list[int], store: Any) -> LayerStep:
    index = torch.tensor(rows, device=step.query.device)

    def pick(value: torch.Tensor | None) -> torch.Tensor | None:
        return None if value is None else value.index_select(0, index.to(value.device))

    return dataclasses.replace(
        step, store=store, query=pick(step.query), query_valid=pick(step.query_valid),
        layer_inputs=pick(step.layer_inputs), padding=pick(step.padding), _memo={},
    )


def select_by_row(
    selector: Selector, step: LayerStep, memo: dict[int, list[dict[str, int]] | None]
) -> torch.Tensor | Selection | None:
    """``selector.select(step)``, with each row's own configuration (see the module docstring)."""
    state = _state(step)
    if state is None:
        return selector.select(step)
    if state.dirty or step.layer_idx not in memo:
        memo[step.layer_idx] = selector.row_config(step.store)
    configs = memo[step.layer_idx]
    if configs is None:
        return selector.select(step)
    held = step.store.lengths().amax(dim=1).tolist()  # host
    budget = getattr(selector, "k", 0)
    groups: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for row, config in enumerate(configs):
        if held[row] > budget:
            groups.setdefault(tuple(sorted(config.items())), []).append(row)
    if len(groups) <= 1:
        return selector.select(step)  # one configuration: the longest row's is every selecting row's
    state.dirty = False  # the configurations are fixed until the next prompt or layout change, as alone
    parts: list[tuple[list[int], torch.Tensor | Selection]] = []
    read, full = state.read_bytes, state.full_bytes
    for key, rows in groups.items():
        store = _restricted(step.store, rows)
        selector.preset(store, dict(key))
        sub_step = _rows_of(step, rows, store)
        sub_state = _state(sub_step)
        assert sub_state is not None
        sub_state.read_bytes, sub_state.full_bytes = 0, 0
        result = selector.select(sub_step)
        assert result is not None  # every row of the group holds more than the token budget
        read, full = read + sub_state.read_bytes, full + sub_state.full_bytes
        parts.append((rows, result))
    state.read_bytes, state.full_bytes, state.steps = read, full, state.steps + 1
    return _assemble(parts, step.query.shape[0])


def _assemble(parts: list[tuple[list[int], torch.Tensor | Selection]], batch: int) -> torch.Tensor | Selection:
    """One ``(batch, q_heads, k)`` subset (or :class:`Selection`) from the groups'; rows in no group (they
    attend to everything, the engine's per-row rule) get the first group's first row's (never read)."""
    first = parts[0][1]

    def gather(field: str) -> torch.Tensor:
        sample = getattr(first, field) if isinstance(first, Selection) else first
        out = sample[:1].expand(batch, *sample.shape[1:]).clone()
        for rows, result in parts:
            value = getattr(result, field) if isinstance(result, Selection) else result
            out[torch.tensor(rows, device=out.device)] = value
        return out

    if isinstance(first, Selection):
        return Selection(indices=gather("indices"), weight=gather("weight"), fallback=gather("fallback"))
    return gather("indices")
