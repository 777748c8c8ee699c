"""``global`` allocator — one budget over every layer and KV head (DBTrimKV, Bui et al., 2026,
arXiv:2605.09649, Sec. 4.2: keep the top ``L·H·M`` entries of all layers and heads at once; the same top-k
as AdaKV's, over a whole model).

The nominal per-head budgets of every managed layer are summed into one total per batch row; the
counts then follow the scores of *all* heads of *all* layers (each head first gets ``floor`` entries,
and always keeps the entries its scorer marks ``+inf``). Per-head lengths are ragged and the store
frees the memory. Decided once per forward, after the last managed layer, so it works with the
``prefill`` and ``decode`` schedules but not ``blockwise`` (whose blocks evict inside one layer).
Scores of different layers are compared directly: use it with scores that are comparable across
layers (learned retention, normalised attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.core.part import PolicyConfigError, require_int
from kvsieve.ops.adaptive_counts import adaptive_counts
from kvsieve.parts.allocators.base import Allocator

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec


@dataclass(frozen=True)
class GlobalBudget(Allocator):
    """Top ``Σ budget`` entries over all layers and heads of a batch row; optional floor per head."""

    name: ClassVar[str] = "global"
    scope: ClassVar[str] = "global"
    SCHEDULES: ClassVar[tuple[str, ...]] = ("prefill", "decode")
    floor: int = 0

    def validate(self) -> None:
        require_int(self.name, "floor", self.floor, 0)

    def check(self, spec: BudgetSpec) -> None:
        """Every head keeps its protected window *and* its floor, all out of the global ``L·H·budget``: the
        two together must fit one head's budget, or the total would exceed the global budget."""
        if spec.budget is None:
            return
        window = spec.window
        if window + self.floor > spec.budget:
            raise PolicyConfigError(
                f"{spec.name}: window ({window}) + floor ({self.floor}) must not exceed budget ({spec.budget}): "
                "every head keeps its window and its floor out of the global budget of L·H·budget entries; "
                f"allowed floor range is [0, {max(spec.budget - window, 0)}]"
            )

    def allocate(self, scores: torch.Tensor, nominal: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.allocate_global([scores], [nominal], [lengths])[0]

    def allocate_global(
        self, scores: list[torch.Tensor], nominal: list[torch.Tensor], lengths: list[torch.Tensor],
        statistics: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        width = max(s.shape[-1] for s in scores)
        padded = [torch.nn.functional.pad(s.float(), (0, width - s.shape[-1]), value=float("-inf")) for s in scores]
        stacked = torch.cat(padded, dim=1)  # (batch, Σ heads, width)
        all_lengths = torch.cat(lengths, dim=1)
        total = torch.cat(nominal, dim=1).sum(dim=1)
        protected = torch.isposinf(stacked).sum(dim=-1)
        floor = torch.minimum(protected + self.floor, all_lengths)
        counts = adaptive_counts(stacked, total, floor, all_lengths)
        return list(torch.split(counts, [s.shape[1] for s in scores], dim=1))
