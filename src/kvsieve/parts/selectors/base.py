"""Selector: decoding-time subset attention that deletes nothing.

At every decoding step of a managed layer, ``select(step)`` returns, per query head, the indices
(``(batch, q_heads, k)``) of the held entries the query attends to; the kernel gathers only those.
Memory equals what the cache holds; only the attention (and KV traffic) is sparse. Quest, SparQ and
RocketKV's hybrid sparse attention are selectors too; ``exact_topk`` is their oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.store import LayerStore, SideSpec, StoreHook
from kvsieve.core.part import Part
from kvsieve.core.selection import Selection
from kvsieve.core.step import LayerStep


@dataclass(frozen=True)
class Selector(Part):
    """Base selector (abstract)."""

    kind: ClassVar[str] = "selector"
    #: ``k``, the entries each decoding query attends to, is the policy's budget.
    budget_fields: ClassVar[tuple[str, ...]] = ("k",)

    def side(self) -> tuple[SideSpec, ...]:
        """Per-entry side data the selector reads (kept by every store of the policy, whatever its action)."""
        return ()

    def hooks(self) -> list[StoreHook]:
        """Per-store data the selector keeps up to date (e.g. per-page key min/max); fresh objects per store."""
        return []

    def row_config(self, store: LayerStore) -> list[dict[str, int]] | None:
        """The configuration each batch row would get alone (page size, dimensions...), derived from what the
        row holds at the first decoding step after a prompt; None: the selector has none (decided per row
        already). Rows whose configurations differ are selected group by group (:mod:`kvsieve.engine.row_groups`)."""
        return None

    def preset(self, store: LayerStore, config: dict[str, int]) -> None:
        """Install ``config`` (one of :meth:`row_config`'s) in a fresh store's hooks, as its first decoding
        step would have."""

    def select(self, step: LayerStep) -> torch.Tensor | Selection | None:
        """Indices ``(batch, q_heads, k)`` into the dense view's entries (or a :class:`Selection` that also
        mixes the output with a fallback); None: attend to every entry."""
        raise NotImplementedError(f"{type(self).__name__} must implement select()")
