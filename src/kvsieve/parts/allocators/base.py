"""Allocator: how many entries each (layer, KV head) keeps.

An allocator turns the policy's budget (``budget`` entries per head, or a ``ratio`` of held entries
removed) into a *nominal* per-head budget for a layer (:meth:`Allocator.nominal`; scorers whose score
depends on the budget read it), then, from the scores, into the counts each head keeps
(:meth:`Allocator.allocate`). Layer-scope allocators decide per layer after that layer's forward;
global-scope ones (:class:`~kvsieve.parts.allocators.global_budget.GlobalBudget`) decide once for all
layers after the last managed layer of a forward (:meth:`Allocator.allocate_global`).

Each batch row is its own request: its nominal budgets come from its own lengths and its counts from
its own scores, never from the other rows of the batch. A ratio keeps ``⌈n·(1 - ratio)⌉`` of the ``n``
entries a head holds (the decimal ratio: ``ratio=0.7`` keeps 3 of 10, not 4 through the float error of
``1 - 0.7``). Entries a scorer protects (``+inf``: the observation window, sinks, a recent share) are
always kept: when the target is smaller than the protected window (``snapkv`` with ``ratio=0.8`` and
``window=8`` on 10 tokens: target 2), a head keeps ``max(target, protected)`` entries, clamped to what it
holds. With an absolute ``budget`` the window never exceeds it (validated), so nothing changes there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.core.part import Part

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec
    from kvsieve.core.step import LayerStep


def ratio_budget(lengths: torch.Tensor, ratio: float) -> torch.Tensor:
    """``⌈n·(1 - ratio)⌉`` per head of ``n`` entries, free of binary rounding (``10·(1 - 0.7)`` is 3, not 4)."""
    kept = lengths.double() * (1.0 - float(ratio))
    # ratio, 1 - ratio and the product are each within an ulp of their decimal values: a few n·2⁻⁵³ in all,
    # which 1e-12·n absorbs (a decimal ratio of d digits is off an integer by ≥ 10⁻ᵈ otherwise).
    return torch.ceil(kept - 1e-12 * lengths.double().clamp(min=1.0)).clamp(min=0).long()


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
    #: Statistics read from the :class:`LayerStep` by :meth:`layer_statistic` (CAKE's window attention).
    NEEDS: ClassVar[frozenset[str]] = frozenset()

    def schedules(self) -> tuple[str, ...]:
        return self.SCHEDULES

    def needs(self) -> frozenset[str]:
        return self.NEEDS

    def layer_statistic(self, step: LayerStep) -> torch.Tensor | None:
        """A per-row statistic ``(batch,)`` of one layer that a global allocator divides its budget by (CAKE's
        layer preference); read when the layer is scored, handed to :meth:`allocate_global`. Default: none."""
        return None

    def layer_budget(self, budget: int, layer_idx: int, num_layers: int, window: int) -> int:
        """Per-head budget of one layer for a policy ``budget`` (uniform: the budget itself)."""
        return budget

    def nominal(
        self, spec: BudgetSpec, lengths: torch.Tensor, layer_idx: int, num_layers: int, window: int
    ) -> torch.Tensor:
        """Per-head budget ``(batch, heads)`` of a layer holding ``lengths`` entries, before redistribution."""
        if spec.budget is not None:
            return torch.full_like(lengths, self.layer_budget(spec.budget, layer_idx, num_layers, window))
        assert spec.ratio is not None
        return ratio_budget(lengths, spec.ratio)

    def allocate(self, scores: torch.Tensor, nominal: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Entries kept per (batch, KV head): ``max(nominal, protected)``, never more than held.

        ``protected`` counts the head's ``+inf`` scores (the entries its scorer always keeps): a target
        below the protected window (a ratio of a short prompt) still keeps the whole window.
        """
        protected = torch.isposinf(scores).sum(dim=-1).to(lengths.device)
        return torch.minimum(torch.maximum(nominal, protected), lengths)

    def allocate_global(
        self, scores: list[torch.Tensor], nominal: list[torch.Tensor], lengths: list[torch.Tensor],
        statistics: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Counts per layer for a global allocator (layer-scope allocators never receive this call);
        ``statistics``: each layer's :meth:`layer_statistic` when the allocator has one."""
        raise NotImplementedError(f"{type(self).__name__} allocates per layer")


Uniform = Allocator
