"""Prompt plans that wait for the prompt to end, and the one place plans are executed.

**Prompts end at the first decoding step.** A multi-token forward computes its plan at its end, but the
plan is applied when the layer is next used by a single-token (decoding) forward, or when the cache is
inspected or copied (:meth:`Deferral.flush`). A multi-token forward that finds a plan waiting continues
the same prompt (``generate(..., prefill_chunk_size=m)`` feeds a prompt in chunks): the waiting plan is
dropped and the prompt is planned again at the end of the new chunk, so a chunked prompt is compressed
once, after its last chunk, exactly like the same prompt in one forward (the window statistics come from
the last chunk; H2O-style accumulators have seen every chunk). A sliding-window trim waits with the plan
and always applies. The ``blockwise`` schedule evicts inside the forward and never defers.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.cache.store import LayerStore
from kvsieve.core.plan import Plan
from kvsieve.core.step import LayerStep
from kvsieve.policies.policy import Policy


@dataclass
class _Deferred:
    """A prompt's compaction (and sliding-window trim) waiting to learn whether the prompt continues."""

    store: LayerStore
    plan: Plan | None
    trim_below: int | None


class Deferral:
    """Waiting prompt plans per layer, and the count of executed compactions."""

    def __init__(self, policy: Policy):
        self.policy = policy
        #: Compactions executed so far (one per layer and firing).
        self.compactions = 0
        self._waiting: dict[int, _Deferred] = {}

    def defers(self, step: LayerStep) -> bool:
        """A prompt forward's plan waits for the prompt to end (not under ``blockwise``)."""
        return not step.is_decoding and self.policy.schedule.block_length() is None

    def wait(self, layer_idx: int, store: LayerStore, plan: Plan | None, trim_below: int | None) -> None:
        """Hold a layer's plan (None: nothing to compact) and trim until the prompt ends or continues."""
        self._waiting[layer_idx] = _Deferred(store, plan, trim_below)

    def act(self, store: LayerStore, plan: Plan, decoding: bool = False) -> None:
        """Execute a plan on a store now; at a decoding step each head keeps room for the appends until the
        schedule fires again (:meth:`~kvsieve.parts.schedules.Schedule.decoding_reserve`)."""
        with store.reserving(self.policy.schedule.decoding_reserve() if decoding else 0):
            self.policy.action.apply(store, plan)
        self.compactions += 1

    @staticmethod
    def trim(store: LayerStore, min_position: int, decoding: bool = False) -> None:
        """A sliding-window layer's trim: drop entries below ``min_position``. At a decoding step it drops one
        entry per head, so each head keeps one free row and the next step's append fits in place."""
        with store.reserving(1 if decoding else 0):
            store.keep_positions_after(min_position)

    def settle(self, layer_idx: int, continuation: bool) -> None:
        """Apply (the prompt ended) or drop (it continues) a layer's waiting plan; trims always apply."""
        entry = self._waiting.pop(layer_idx, None)
        if entry is None:
            return
        if entry.plan is not None and not continuation:
            self.act(entry.store, entry.plan)
        if entry.trim_below is not None:
            self.trim(entry.store, entry.trim_below)

    def flush(self) -> None:
        """Apply every waiting prompt compaction now (before inspecting, copying or reordering the cache)."""
        for layer_idx in list(self._waiting):
            self.settle(layer_idx, continuation=False)

    def clear(self) -> None:
        """Forget every waiting plan (the cache was reset)."""
        self._waiting = {}
