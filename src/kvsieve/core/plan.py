"""A compaction plan: what each head keeps and, for merging actions, where the rest goes.

A plan is data, so making it (scores → allocator → action) and executing it (the action on the store)
are separate, and a plan can be checked against a brute-force reference in tests. Segments are the
store's (batch item, KV head) pairs, ``s = b·heads + h``; indices are local to a segment's held entries
in position order (the dense view's last axis).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Plan:
    """Per segment: entries kept, and optionally entries merged into kept ones.

    Attributes:
        keep: ``(segments, K)`` local indices of the kept entries, ascending; entries past ``counts[s]``
            are filler and ignored.
        counts: ``(segments,)`` entries kept (host ``long`` tensor).
        merge_source: ``(segments, M)`` local indices of entries folded into a kept one (``-1``: none).
        merge_target: ``(segments, M)`` rank in ``keep`` (``0 ≤ r < counts[s]``) of the receiving entry.
        merge_weight: ``(segments, M)`` weight of each merged entry (e.g. its attention score).
        keep_weight: ``(segments, K)`` weight of each kept entry itself in a merge (None: its token count).
        tiers: ``(segments, K)`` precision tier of each kept entry (0: the model dtype; ``t ≥ 1``: the store's
            ``t``-th quantized tier; None: every entry stays where it is) — quantizing actions only.
        dropped: ``(segments,)`` local index of the one entry each segment drops, when the plan keeps all but one
            entry of every segment (``keep`` says the same; an evicting action may execute it as
            :meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_one`); None otherwise.
    """

    keep: torch.Tensor
    counts: torch.Tensor
    merge_source: torch.Tensor | None = None
    merge_target: torch.Tensor | None = None
    merge_weight: torch.Tensor | None = None
    keep_weight: torch.Tensor | None = None
    tiers: torch.Tensor | None = None
    dropped: torch.Tensor | None = None

    @property
    def merges(self) -> bool:
        return self.merge_source is not None and bool((self.merge_source >= 0).any())

    def kept_local(self, segment: int) -> torch.Tensor:
        """Local indices one segment keeps (for inspection and tests)."""
        return self.keep[segment, : int(self.counts[segment])]


class DropOnePlan(Plan):
    """A :class:`Plan` keeping all but one entry of every segment (every-step decoding eviction), built from the
    ``dropped`` local indices alone: its ``keep`` — every local index but the dropped one, ascending — is made only
    when something reads it. The store executes such a plan from ``dropped``
    (:meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_one`), so the usual step makes no ``keep`` at all (two
    device operations less per layer and step)."""

    def __init__(self, dropped: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor) -> None:
        """``dropped`` ``(segments,)``; ``counts`` ``(segments,)`` host ``long`` (each the kept width);
        ``offsets``: ``arange(width)`` on ``dropped``'s device."""
        self._keep: torch.Tensor | None = None
        self._offsets = offsets
        super().__init__(None, counts, dropped=dropped)  # type: ignore[arg-type]  # ``keep`` is made on demand

    @property  # type: ignore[override]
    def keep(self) -> torch.Tensor:
        if self._keep is None:
            assert self.dropped is not None
            offsets = self._offsets[None, :]
            self._keep = offsets + (offsets >= self.dropped[:, None])
        return self._keep

    @keep.setter
    def keep(self, value: torch.Tensor | None) -> None:
        self._keep = value
