"""The one warning of a prompt forward that compressed nothing (the budget covers the whole prompt)."""

from __future__ import annotations

import warnings

from kvsieve.policies.policy import Policy


class NoopWarning:
    """Warns once per cache when a whole ``prefill``-schedule prompt forward compressed no layer."""

    def __init__(self, policy: Policy, managed: tuple[int, ...]):
        self.policy = policy
        self.managed = managed
        self._forward_compressed = False
        self._warned = False

    def note_forward(self, layer_idx: int, is_decoding: bool, compressed: bool, seen: int) -> None:
        """A managed layer's prompt forward ended (layer-scope allocators); warns after the last one."""
        if is_decoding or not self.managed or self.policy.schedule.name != "prefill":
            return
        if layer_idx == self.managed[0]:
            self._forward_compressed = False
        self._forward_compressed |= compressed
        if layer_idx == self.managed[-1]:
            self.warn_if_noop(self._forward_compressed, seen)

    def warn_if_noop(self, compressed: bool, seen: int) -> None:
        """Warn (once) unless the forward compressed something; ``seen``: tokens seen so far."""
        if compressed or self._warned or self.policy.schedule.name != "prefill":
            return
        self._warned = True
        # stacklevel: two frames here, then the engine's (or the global plans') two frames of the layer step
        warnings.warn(
            f"kvsieve: {self.policy}: nothing was compressed in this prompt forward (the budget, or the "
            f"entries its scorer always keeps, cover all {seen} tokens seen so far); later forwards compress once the "
            "cache outgrows the budget",
            stacklevel=4,
        )

    def warn_unreconstructed(self) -> None:
        """Warn (once) that a reconstructing scorer (KVzip) saw a prompt with no reconstruction run yet."""
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"kvsieve: {self.policy.name}: its scores come from a context reconstruction, which has not run: "
            "nothing is evicted until kvsieve.reconstruct(model, tokenizer, cache, input_ids) runs after the "
            "prefill (kvsieve.compress_context and kvsieve eval run it for you)",
            stacklevel=4,
        )
