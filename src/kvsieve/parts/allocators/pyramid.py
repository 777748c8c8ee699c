"""``pyramid`` allocator (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling", arXiv:2406.02069).

Per-layer budgets decrease linearly from the bottom layer to the top with the same total:
``min = (B - w) / β``, ``max = 2 (B - w) - min``, layer ``l`` keeps ``⌊max - l · (max - min) / (L - 1)⌋ + w``
entries per head, β = 20, ``w`` the scorer's observation window. The reference code rounds the step
down, which can push the total above ``L·B``; flooring each exact layer budget keeps the total at or
below ``L·B`` (equal up to rounding).

As the reference ``PyramidKVCluster.update_kv`` does, the pyramid applies only to long prompts: a batch
row whose ``n`` held entries per head fit the budget (``n ≤ B``) keeps everything in every layer (a
covering budget equals ``full``), and one with ``n < 2 (B - w)`` keeps a uniform ``B`` per head (SnapKV's
selection); the layer budgets above apply from ``n ≥ 2 (B - w)``. Decided per row, from its own length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.core.part import PolicyConfigError, require_bool, require_int
from kvsieve.core.preset import Preset
from kvsieve.parts.allocators.base import Allocator
from kvsieve.parts.scorers.snapkv import WindowAttention

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec


@dataclass(frozen=True)
class Pyramid(Allocator):
    """Pyramidal (linearly decreasing) layer budgets with the same total as uniform."""

    name: ClassVar[str] = "pyramid"
    accepts_ratio: ClassVar[bool] = False
    aliases: ClassVar[dict[str, str]] = {"pyramid_beta": "beta"}
    beta: int = 20
    #: The reference's regimes for short prompts (keep all when ``n ≤ B``, uniform below ``2 (B - w)``);
    #: False: the pyramid at every length (kvsieve ≤ 0.1, which evicted under a covering budget).
    reference_regimes: bool = True

    def validate(self) -> None:
        require_int(self.name, "beta", self.beta, 1)
        require_bool(self.name, "reference_regimes", self.reference_regimes)

    def check(self, spec: BudgetSpec) -> None:
        if spec.budget is None:
            raise PolicyConfigError(f"{spec.name}: needs an absolute budget (int ≥ 1), not a ratio")

    def nominal(
        self, spec: BudgetSpec, lengths: torch.Tensor, layer_idx: int, num_layers: int, window: int
    ) -> torch.Tensor:
        """The layer's pyramid budget for rows of long prompts; all entries, or a uniform budget, for short ones."""
        layered = super().nominal(spec, lengths, layer_idx, num_layers, window)
        if not self.reference_regimes:
            return layered
        budget = spec.budget
        assert budget is not None  # validated: the pyramid needs an absolute budget
        held = lengths.amax(dim=1, keepdim=True).expand_as(lengths)  # the row's prompt, per head
        uniform = torch.full_like(layered, budget)
        return torch.where(held <= budget, lengths, torch.where(held < 2 * (budget - window), uniform, layered))

    def layer_budget(self, budget: int, layer_idx: int, num_layers: int, window: int) -> int:
        if num_layers == 1:
            return budget
        spare = budget - window
        low = spare / self.beta
        high = 2 * spare - low
        return int(high - layer_idx * (high - low) / (num_layers - 1)) + window


PRESETS = (
    Preset("pyramidkv", "snapkv scores, layer budgets decreasing with depth", scorer=WindowAttention(),
           allocator=Pyramid()),
)
