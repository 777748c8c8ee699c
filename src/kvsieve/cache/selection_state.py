"""The store hook in which a decoding-time selector keeps its configuration and measures its KV traffic.

``KVCache.traffic()`` totals what these hooks report through :meth:`StoreHook.traffic`, so the cache
knows no selector; the selectors themselves are in :mod:`kvsieve.parts.selectors`.
"""

from __future__ import annotations

import torch

from kvsieve.cache.store import LayerStore, StoreHook


class SelectionState(StoreHook):
    """Per-store state of a selector: its configuration for the current prompt and the traffic it measured.

    ``dirty`` is set by a prompt (an append of more than one entry per segment) or a layout change
    (compaction, batch reorder); the selector then derives its configuration (page size, dimensions)
    from what the store holds at the first decoding step — the paper fixes them per input length.
    """

    def __init__(self) -> None:
        self.dirty = True
        self.config: dict[str, int] = {}
        #: Bytes read by the selector's decoding steps (int or a 0-dim tensor: no host sync).
        self.read_bytes: int | torch.Tensor = 0
        #: Bytes full attention would have read at the same steps (every held key and value).
        self.full_bytes = 0
        self.steps = 0

    def after_append(self, store: LayerStore, rows: torch.Tensor | None, count: int) -> None:
        if count > 1:
            self.dirty = True

    def after_layout(self, store: LayerStore) -> None:
        self.dirty = True

    def record(self, store: LayerStore, read: int | torch.Tensor) -> None:
        """One decoding step read ``read`` bytes; full attention would have read every held key and value (as
        held: a quantized entry's codes, steps and minimums)."""
        self.read_bytes = self.read_bytes + read
        self.full_bytes += store.kv_nbytes()
        self.steps += 1

    def traffic(self) -> tuple[int | torch.Tensor, int, int]:
        return self.read_bytes, self.full_bytes, self.steps


def state_of(store: LayerStore) -> SelectionState:
    for hook in store.hooks:
        if isinstance(hook, SelectionState):
            return hook
    raise RuntimeError("the store has no SelectionState hook (the selector's hooks() were not installed)")


def record_if_measured(store: LayerStore, read: int | torch.Tensor) -> None:
    """Add ``read`` bytes to the store's :class:`SelectionState` if it has one (a bare store has none)."""
    for hook in store.hooks:
        if isinstance(hook, SelectionState):
            hook.record(store, read)
            return


def hook_of(store: LayerStore, kind: type[StoreHook]) -> StoreHook:
    for hook in store.hooks:
        if type(hook) is kind:
            return hook
    raise RuntimeError(f"the store has no {kind.__name__} hook (the selector's hooks() were not installed)")


def selected_nbytes(store: LayerStore, chosen: torch.Tensor, values_only: bool = False) -> int | torch.Tensor:
    """Bytes of the entries at indices ``chosen`` ``(batch, kv_heads or q_heads, k)`` into the dense view, as
    held: a full-precision key + value (or value alone) each, a quantized one its tier's share of its group's
    codes, steps and minimums (a 0-dim tensor then, summed on the device: no host sync)."""
    if not store.tiered:
        return chosen.numel() * store.full_entry_nbytes(values_only)
    tier_of, _ = store.origins()  # (batch, kv_heads, L): 0 full precision, t ≥ 1 tier t - 1
    table = store.entry_nbytes_on(chosen.device, values_only)
    index = chosen.reshape(chosen.shape[0], tier_of.shape[1], -1)  # a query head's picks under its KV head
    return table[tier_of.to(chosen.device).gather(2, index)].sum()


def held_key_nbytes(store: LayerStore) -> int:
    """Bytes of every held key, as held (a quantized key: its packed code and its group's steps and minimums)."""
    full = store.total_entries() * store.keys.element_size() * store.head_dim
    return full + sum(int(tier.groups_per_segment.sum()) * (tier.group_nbytes() - tier.group_nbytes(True))
                      for tier in store.tiers)
