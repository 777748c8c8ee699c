"""Per-page key min/max over a *filtered subset* of a layer store (RocketKV-MT: RocketKV, Behnam et al., 2025,
arXiv:2502.14051, Sec. 3.5): the store holds every entry, a boolean side datum marks the members (what the
turn's stage-1 filter kept, plus every entry appended since), and pages of ``page_size`` consecutive *members*
carry element-wise key max/min, exactly like :class:`~kvsieve.cache.pages.PageMinMax` over the members alone.

Decoding appends (one entry per segment) are members: they are added to the member index and update
the page they land in (``scatter_reduce_`` amax/amin), no host sync. A prompt (several entries per
segment), a re-filter (the side datum rewritten) or a compaction rebuilds everything from the side datum.
"""

from __future__ import annotations

import math

import torch

from kvsieve.cache.store import LayerStore, SideSpec, StoreHook

#: Side datum marking the entries RocketKV-MT's stage-1 filter kept for this turn (True for new entries).
STAGE1_KEEP = SideSpec("stage1_keep", (), torch.bool, 1.0)

#: Member slots added per segment when a decoding append needs one more.
MEMBER_GROWTH = 64


class MemberPages(StoreHook):
    """Member index ``(segments, cap)`` (dense-view indices, in position order) and page max/min over members."""

    def __init__(self, page_size: int, side: str):
        if page_size < 1:
            raise ValueError(f"page_size must be an int ≥ 1; got {page_size!r}")
        self.page_size, self.side = page_size, side
        self.index = torch.empty(0, dtype=torch.long)
        self.count = torch.empty(0, dtype=torch.long)
        self.kmax = torch.empty(0)
        self.kmin = torch.empty(0)
        self.cap = 0  # member slots per segment
        self.slots = 0  # page slots per segment
        self.max_count = 0  # host upper bound of the member counts (exact after a rebuild)

    # ------------------------------------------------------------------ reading
    def members(self, store: LayerStore) -> tuple[torch.Tensor, torch.Tensor]:
        """``(batch, heads, M)`` member indices into the dense view and their validity (``M`` = most members)."""
        m = self.max_count
        index = self.index.view(store.batch, store.heads, self.cap)[:, :, :m]
        valid = torch.arange(m, device=index.device)[None, :] < self.count[:, None]
        return index, valid.view(store.batch, store.heads, m)

    def view(self, store: LayerStore) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (store.batch, store.heads, self.slots, store.head_dim)
        return self.kmax.view(shape), self.kmin.view(shape)

    def nbytes(self) -> int:
        return self.kmax.nbytes + self.kmin.nbytes + self.index.nbytes + self.count.nbytes

    # ------------------------------------------------------------------ hooks
    def after_layout(self, store: LayerStore) -> None:
        view = store.dense()
        b, h, length, d = view.keys.shape
        device = view.keys.device
        member = view.extras[self.side].to(torch.bool)
        if view.valid is not None:
            member = member & view.valid
        counts = member.sum(dim=-1).reshape(-1)
        most = int(counts.max()) if counts.numel() else 0
        order = torch.where(member, torch.arange(length, device=device), length)
        index = torch.sort(order, dim=-1).values[..., :most].clamp(max=max(length - 1, 0))
        self.cap = most + MEMBER_GROWTH
        self.slots = math.ceil(self.cap / self.page_size)
        self.index = torch.zeros(b * h, self.cap, dtype=torch.long, device=device)
        self.index[:, :most] = index.reshape(b * h, most)
        self.count, self.max_count = counts, most
        dtype = view.keys.dtype  # min/max of stored keys are stored keys: exact in their own dtype
        self.kmax = torch.full((b * h * self.slots, d), -math.inf, dtype=dtype, device=device)
        self.kmin = torch.full((b * h * self.slots, d), math.inf, dtype=dtype, device=device)
        if most == 0:
            return
        keys = view.keys.gather(2, index[..., None].expand(-1, -1, -1, d))  # (b, h, M, d)
        valid = torch.arange(most, device=device)[None, :] < counts[:, None]
        pages = math.ceil(most / self.page_size)
        padded = pages * self.page_size
        keys = torch.nn.functional.pad(keys.reshape(b * h, most, d), (0, 0, 0, padded - most))
        valid = torch.nn.functional.pad(valid, (0, padded - most), value=False)
        keys = keys.view(b * h, pages, self.page_size, d)
        valid = valid.view(b * h, pages, self.page_size, 1)
        self.kmax.view(b * h, self.slots, d)[:, :pages] = keys.masked_fill(~valid, -math.inf).amax(dim=2)
        self.kmin.view(b * h, self.slots, d)[:, :pages] = keys.masked_fill(~valid, math.inf).amin(dim=2)

    def after_append(self, store: LayerStore, rows: torch.Tensor | None, count: int) -> None:
        if count > 1 or self.side not in store.extras:
            self.after_layout(store)
            return
        device = store.keys.device
        if rows is None:  # uniform: one new entry at the end of every segment
            segments = torch.arange(store.segments, device=device)
            local = torch.full((store.segments,), store.max_length - 1, dtype=torch.long, device=device)
            flat_rows = segments * (store.keys.shape[0] // store.segments) + local
        else:
            flat_rows = rows
            segments = store.segments_of(rows)
            local = rows - store.start.to(device)[segments]
        local = store.dense_slots(local, segments)  # after the segment's quantized entries, if any
        if self.max_count + 1 > self.cap:
            self._grow(store, self.max_count + 1 + MEMBER_GROWTH)
        slot = self.count[segments]
        self.index.view(-1).index_put_((segments * self.cap + slot,), local)
        self.count = self.count.index_add(0, segments, torch.ones_like(segments))
        self.max_count += 1
        keys = store.keys.index_select(0, flat_rows)
        index = (segments * self.slots + slot // self.page_size)[:, None].expand(-1, keys.shape[-1])
        self.kmax.scatter_reduce_(0, index, keys, "amax", include_self=True)
        self.kmin.scatter_reduce_(0, index, keys, "amin", include_self=True)

    def _grow(self, store: LayerStore, cap: int) -> None:
        segs, d = store.segments, store.head_dim
        slots = math.ceil(cap / self.page_size)
        index = torch.zeros(segs, cap, dtype=torch.long, device=self.index.device)
        index[:, : self.cap] = self.index
        kmax = torch.full((segs * slots, d), -math.inf, dtype=self.kmax.dtype, device=self.kmax.device)
        kmin = torch.full((segs * slots, d), math.inf, dtype=self.kmin.dtype, device=self.kmin.device)
        kmax.view(segs, slots, d)[:, : self.slots] = self.kmax.view(segs, self.slots, d)
        kmin.view(segs, slots, d)[:, : self.slots] = self.kmin.view(segs, self.slots, d)
        self.index, self.kmax, self.kmin, self.cap, self.slots = index, kmax, kmin, cap, slots
