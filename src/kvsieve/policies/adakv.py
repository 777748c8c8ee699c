"""``adakv`` — adaptive head-wise budgets over any base score (Feng et al. 2024, "Ada-KV",
arXiv:2407.11550).

The layer's ``H·B`` entries are split across its KV heads by a global top-k over the base policy's
scores (SnapKV by default) with a floor of ``α·B`` per head (α = 0.2). Heads really hold different
numbers of entries (ragged storage), so the freed memory is real, unlike masking implementations.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.budgets.adaptive import adaptive_counts
from kvsieve.policies.base import Policy, PolicyConfigError
from kvsieve.policies.registry import policy_class, register


@register
@dataclass(frozen=True)
class AdaKV(Policy):
    """Head-wise adaptive allocation wrapping the score of ``base``."""

    name: ClassVar[str] = "adakv"
    schedules: ClassVar[tuple[str, ...]] = ("prefill", "blockwise")
    base: str = "snapkv"
    alpha: float = 0.2
    window: int = 32

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.alpha <= 1.0:
            raise PolicyConfigError(f"adakv: alpha must be in [0, 1]; got {self.alpha!r}")
        if self.base == self.name:
            raise PolicyConfigError("adakv: base must be a scoring policy other than adakv")
        base_cls = policy_class(self.base)
        if not base_cls.evicts or not base_cls.needs_budget:
            raise PolicyConfigError(f"adakv: base {self.base!r} has no eviction score to allocate with")

    def base_policy(self) -> Policy:
        """The wrapped scoring policy with this policy's budget (and window, when it has one)."""
        cls = policy_class(self.base)
        params: dict[str, object] = {"budget": self.budget, "ratio": self.ratio}
        if "window" in {f.name for f in fields(cls)}:
            params["window"] = self.window
        return cls(**params)

    def observe(self, step: LayerStep) -> None:
        self.base_policy().observe(step)

    def score(self, step: LayerStep) -> torch.Tensor:
        return self.base_policy().score(step)

    def allocate(self, scores: torch.Tensor, step: LayerStep) -> torch.Tensor:
        lengths = step.lengths()
        target = self.target(lengths.cpu(), step.layer_idx, step.info.num_layers).to(lengths.device)
        per_head = target[:, 0]
        total = per_head * lengths.shape[1]
        floor = (per_head.double() * self.alpha).long()
        return adaptive_counts(scores, total, floor, lengths)
