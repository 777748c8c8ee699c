"""Ragged per-(batch item, KV head) storage of one attention layer.

Every (batch item, KV head) pair owns a *segment* of flat key/value buffers. A segment that keeps
100 entries holds 100 entries (plus, during decoding, a small growth slack that is reported in
``nbytes``): heads with different budgets (AdaKV, DBTrimKV) really use different amounts of memory,
unlike masking schemes that keep a padded maximum.

Layout: buffers of shape ``(total_capacity, head_dim)``; segment ``s = b * heads + h`` occupies rows
``[start[s], start[s] + capacity[s])`` and its first ``length[s]`` rows are valid, in increasing
position order. When all segments have the same length and capacity, ``dense()`` is a zero-copy
view of shape ``(batch, heads, length, head_dim)``; otherwise it gathers into a padded tensor with a
validity mask (a transient the size of one layer's attention input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Entries added per segment whenever an append does not fit (amortised O(1) appends at decoding).
GROWTH = 64


@dataclass
class DenseView:
    """Padded ``(batch, heads, L, ...)`` view of a layer store; ``valid`` is None when nothing is padded."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None
    extras: dict[str, torch.Tensor]


class RaggedLayerStore:
    """Keys, values, absolute positions and per-entry side data of one layer, ragged per segment."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.dtype, self.device = dtype, device
        segments = batch * heads
        self.keys = torch.empty((0, head_dim), dtype=dtype, device=device)
        self.values = torch.empty((0, head_dim), dtype=dtype, device=device)
        self.positions = torch.empty((0,), dtype=torch.long, device=device)
        self.extras: dict[str, torch.Tensor] = {}
        self.start = torch.zeros(segments, dtype=torch.long)
        self.length = torch.zeros(segments, dtype=torch.long)
        self.capacity = torch.zeros(segments, dtype=torch.long)
        #: Most entries any segment has held at once (right after an append, before compaction).
        self.peak_length = 0

    # ------------------------------------------------------------------ inspection
    @property
    def segments(self) -> int:
        return self.batch * self.heads

    def lengths(self) -> torch.Tensor:
        """Entries held per (batch item, KV head), shape ``(batch, heads)``."""
        return self.length.view(self.batch, self.heads).clone()

    def nbytes(self) -> int:
        """Bytes allocated for keys, values, positions and side data (growth slack included)."""
        total = self.keys.nbytes + self.values.nbytes + self.positions.nbytes
        return total + sum(t.nbytes for t in self.extras.values())

    def used_nbytes(self) -> int:
        """Bytes of the entries actually held (growth slack excluded)."""
        per_entry = (self.keys.element_size() + self.values.element_size()) * self.head_dim
        per_entry += self.positions.element_size()
        per_entry += sum(t[:1].nbytes for t in self.extras.values())
        return int(self.length.sum()) * per_entry

    def is_uniform(self) -> bool:
        """All segments have equal length and capacity, laid out back to back (zero-copy dense view)."""
        if self.segments == 0:
            return True
        cap = int(self.capacity[0])
        return bool(
            (self.length == self.length[0]).all()
            and (self.capacity == cap).all()
            and (self.start == torch.arange(self.segments) * cap).all()
        )

    # ------------------------------------------------------------------ dense access
    def _gather_index(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        max_len = int(self.length.max()) if self.segments else 0
        offs = torch.arange(max_len)
        valid = offs[None, :] < self.length[:, None]
        last = (self.start + (self.length - 1).clamp(min=0))[:, None]
        index = torch.minimum(self.start[:, None] + offs[None, :], last)
        index = index.clamp(max=max(self.keys.shape[0] - 1, 0))
        return index.to(self.device), valid.to(self.device), max_len

    def dense(self) -> DenseView:
        """Padded view ``(batch, heads, L, ...)`` of all entries; ``valid`` is None if nothing is padded."""
        b, h, d = self.batch, self.heads, self.head_dim
        if self.is_uniform():
            length, cap = int(self.length[0]) if self.segments else 0, int(self.capacity[0]) if self.segments else 0
            def view(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, h, cap, *t.shape[1:])[:, :, :length]
            return DenseView(
                view(self.keys), view(self.values), view(self.positions), None,
                {name: view(t) for name, t in self.extras.items()},
            )
        index, valid, max_len = self._gather_index()
        flat = index.reshape(-1)
        def gather(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, flat).view(b, h, max_len, *t.shape[1:])
        return DenseView(
            gather(self.keys).view(b, h, max_len, d), gather(self.values).view(b, h, max_len, d),
            gather(self.positions), valid.view(b, h, max_len),
            {name: gather(t) for name, t in self.extras.items()},
        )

    # ------------------------------------------------------------------ mutation
    def ensure_extra(self, name: str, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        """Create per-entry side data ``name`` (one scalar per entry) if absent."""
        if name not in self.extras:
            self.extras[name] = torch.full((self.keys.shape[0],), fill, dtype=dtype, device=self.device)

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        token_valid: torch.Tensor | None,
    ) -> None:
        """Append new entries ``(batch, heads, q, d)`` at absolute ``positions`` ``(q,)``.

        ``token_valid`` ``(batch, q)`` marks real tokens; padding tokens are not stored.
        Side data of new entries starts at 0.
        """
        h, q = keys.shape[1], keys.shape[2]
        if token_valid is None:
            counts = torch.full((self.segments,), q, dtype=torch.long)
        else:
            counts = token_valid.sum(dim=1).cpu().repeat_interleave(h)
        if bool((self.length + counts > self.capacity).any()):
            self._relayout(self.length + counts + GROWTH)
        base = (self.start + self.length).to(self.device)
        if token_valid is None:
            dst = (base[:, None] + torch.arange(q, device=self.device)[None, :]).reshape(-1)
            src_keys, src_values = keys.reshape(-1, self.head_dim), values.reshape(-1, self.head_dim)
            src_pos = positions.repeat(self.segments)
        else:
            valid = token_valid.to(self.device).repeat_interleave(h, dim=0)  # (segments, q)
            rank = valid.long().cumsum(dim=1) - 1
            dst = (base[:, None] + rank)[valid]
            src_keys = keys.reshape(self.segments, q, self.head_dim)[valid]
            src_values = values.reshape(self.segments, q, self.head_dim)[valid]
            src_pos = positions[None, :].expand(self.segments, q)[valid]
        self.keys.index_copy_(0, dst, src_keys.to(self.dtype))
        self.values.index_copy_(0, dst, src_values.to(self.dtype))
        self.positions.index_copy_(0, dst, src_pos)
        for t in self.extras.values():
            t.index_fill_(0, dst, 0)
        self.length += counts
        self.peak_length = max(self.peak_length, int(self.length.max()))

    def _relayout(self, capacity: torch.Tensor) -> None:
        """Move every segment into fresh buffers with the given per-segment capacity."""
        new_start = torch.cumsum(capacity, 0) - capacity
        total = int(capacity.sum())
        offs = torch.arange(int(self.length.max()) if self.segments else 0)
        mask = offs[None, :] < self.length[:, None]
        src = (self.start[:, None] + offs[None, :])[mask].to(self.device)
        dst = (new_start[:, None] + offs[None, :])[mask].to(self.device)
        def move(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((total, *t.shape[1:]), dtype=t.dtype, device=t.device)
            out.index_copy_(0, dst, t.index_select(0, src))
            return out
        self.keys, self.values, self.positions = move(self.keys), move(self.values), move(self.positions)
        self.extras = {name: move(t) for name, t in self.extras.items()}
        self.start, self.capacity = new_start, capacity.clone()

    def keep(self, local_index: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep, per segment ``s``, the entries ``local_index[s, :counts[s]]`` (ascending) and free the rest.

        ``local_index`` is ``(segments, K)`` of indices into each segment; the kept entries are exact
        copies of the originals, in their original order. Capacity shrinks to exactly what is kept.
        """
        counts = counts.to(torch.long).cpu().reshape(-1)
        width = local_index.shape[1]
        mask = torch.arange(width)[None, :] < counts[:, None]
        src = (self.start[:, None].to(local_index.device) + local_index)[mask.to(local_index.device)]
        new_start = torch.cumsum(counts, 0) - counts
        total = int(counts.sum())
        src = src.to(self.device)
        def take(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, src) if total else t[:0].clone()
        self.keys, self.values, self.positions = take(self.keys), take(self.values), take(self.positions)
        self.extras = {name: take(t) for name, t in self.extras.items()}
        self.start, self.length, self.capacity = new_start, counts.clone(), counts.clone()

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder / select batch items (beam search, batch filtering)."""
        segs = (index.cpu()[:, None] * self.heads + torch.arange(self.heads)[None, :]).reshape(-1)
        lengths = self.length[segs]
        max_len = int(lengths.max()) if len(segs) else 0
        offs = torch.arange(max_len)
        local = offs[None, :].expand(len(segs), max_len)
        new = RaggedLayerStore(len(index), self.heads, self.head_dim, self.dtype, self.device)
        new.keys, new.values, new.positions, new.extras = self.keys, self.values, self.positions, self.extras
        new.start, new.length, new.capacity = self.start[segs], lengths, self.capacity[segs]
        new.keep(local, lengths)
        self.__dict__.update(new.__dict__)

    def add_dense(self, name: str, values: torch.Tensor) -> None:
        """Add ``(batch, heads, L)`` values (laid out like :meth:`dense`) into side data ``name``."""
        target = self.extras[name]
        b, h = self.batch, self.heads
        if self.is_uniform():
            cap = int(self.capacity[0]) if self.segments else 0
            length = values.shape[-1]
            target.view(b, h, cap)[:, :, :length] += values.to(target.dtype)
            return
        index, valid, _ = self._gather_index()
        flat_values = values.reshape(self.segments, -1)
        target.index_add_(0, index[valid], flat_values[valid].to(target.dtype))

    def keep_positions_after(self, min_position: int) -> None:
        """Drop every entry whose position is below ``min_position`` (sliding-window layers)."""
        view = self.dense()
        keep = view.positions >= min_position
        if view.valid is not None:
            keep = keep & view.valid
        counts = keep.sum(dim=-1).reshape(-1).cpu()
        if bool((counts == self.length).all()):
            return
        width = keep.shape[-1]
        order = torch.where(keep, torch.arange(width, device=keep.device), width)
        local = torch.sort(order.reshape(self.segments, width), dim=-1).values
        self.keep(local, counts)
