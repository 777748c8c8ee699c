"""Allocator: how many entries each (layer, KV head) keeps.

An allocator turns the policy's budget (``budget`` entries per head, or a ``ratio`` of held entries
removed) into a *nominal* per-head budget for a layer (:meth:`Allocator.nominal`; scorers whose score
depends on the budget read it), then, from the scores, into the counts each head keeps
(:meth:`Allocator.allocate`). Layer-scope allocators decide per layer after that layer's forward;
global-scope ones (:class:`~kvsieve.parts.allocators.global_budget.GlobalBudget`) decide once for all
layers after the last managed layer of a forward (:meth:`Allocator.allocate_global`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.parts.base import Part

if TYPE_CHECKING:
    from kvsieve.policies.policy import Policy


@dataclass(frozen=True)
class Allocator(Part):
    """Uniform budgets: every head of every layer keeps the same ``budget`` (or ``⌈n·(1 - ratio)⌉``)."""

    kind: ClassVar[str] = "allocator"
    name: ClassVar[str] = "uniform"
    #: ``"layer"``: counts decided per layer; ``"global"``: once across all layers and heads.
    scope: ClassVar[str] = "layer"
    #: Whether a ratio budget makes sense with this allocator.
    accepts_ratio: ClassVar[bool] = True
    #: Schedules it can run under (a global budget cannot be decided between the blocks of one layer).
    SCHEDULES: ClassVar[tuple[str, ...]] = ("prefill", "decode", "blockwise")

    def schedules(self) -> tuple[str, ...]:
        return self.SCHEDULES

    def layer_budget(self, budget: int, layer_idx: int, num_layers: int, window: int) -> int:
        """Per-head budget of one layer for a policy ``budget`` (uniform: the budget itself)."""
        return budget

    def nominal(
        self, policy: Policy, lengths: torch.Tensor, layer_idx: int, num_layers: int, window: int
    ) -> torch.Tensor:
        """Per-head budget ``(batch, heads)`` of a layer holding ``lengths`` entries, before redistribution."""
        if policy.budget is not None:
            return torch.full_like(lengths, self.layer_budget(policy.budget, layer_idx, num_layers, window))
        assert policy.ratio is not None
        return torch.ceil(lengths.double() * (1.0 - policy.ratio)).long()

    def allocate(self, scores: torch.Tensor, nominal: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Entries kept per (batch, KV head): the nominal budget, never more than held."""
        return torch.minimum(nominal, lengths)

    def allocate_global(
        self, scores: list[torch.Tensor], nominal: list[torch.Tensor], lengths: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Counts per layer for a global allocator (layer-scope allocators never receive this call)."""
        raise NotImplementedError(f"{type(self).__name__} allocates per layer")


Uniform = Allocator
