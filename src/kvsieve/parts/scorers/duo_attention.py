"""``duo_attention`` scorer — DuoAttention's head split (Xiao et al. 2024, "DuoAttention: Efficient Long-Context
LLM Inference with Retrieval and Streaming Heads", arXiv:2410.10819; kvpress ``DuoAttentionPress``).

Each KV head is either a **retrieval head**, which keeps its whole cache, or a **streaming head**, which keeps
the first ``sinks`` entries and the most recent ones — ``budget`` in all, as StreamingLLM (Sec. 3.1). Which
heads stream comes from a *head pattern* (:mod:`kvsieve.gates.head_pattern`): one retrieval score per
(layer, KV head); the ``streaming_share`` of heads with the lowest scores stream (kvpress's
``head_compression_ratio``; the paper sets the share by a threshold on its gate values, Sec. 3.3).

The paper learns the scores by optimisation: a gate ``α`` per head mixing full and streaming attention,
trained on synthetic passkey data to keep the last hidden states unchanged under an L1 penalty (Sec. 3.2).
kvsieve measures them instead, without gradients (:func:`kvsieve.train.duo.calibrate_head_pattern`,
``kvsieve calibrate-duo``): each head is made the only streaming head in turn, and its score is how much the
model's answer distribution on calibration passkey prompts moves (KL to the full cache per answer token) —
the end-to-end deviation the paper's loss penalises, one head at a time (it does not see interactions
between heads, which the joint optimisation does). A pattern shipped for the default model is used when
``pattern`` is None; another model needs its own (``pattern="path.json"``).

As a scorer, a retrieval head protects every entry (``+inf``: the allocator keeps them all) and a streaming
head ranks by recency with its sinks protected, so any allocator, action or schedule composes with it (with
``schedule="decode"`` streaming heads roll while decoding, as the paper's constant-size streaming cache).
Memory held: ``share·budget + (1 − share)·n`` entries per head on average for an ``n``-token context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.core.part import PolicyConfigError, require_int, require_number
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec
    from kvsieve.gates.head_pattern import HeadPattern


@dataclass(frozen=True)
class HeadSplit(Scorer):
    """Retrieval heads keep everything; streaming heads keep ``sinks`` + the most recent entries."""

    name: ClassVar[str] = "duo_attention"
    SCHEDULES: ClassVar[tuple[str, ...]] = ALL_SCHEDULES
    pattern: str | HeadPattern | None = None  #: None (the shipped pattern), a JSON path, or a HeadPattern
    streaming_share: float = 0.5
    sinks: int = 16

    def validate(self) -> None:
        from kvsieve.gates.head_pattern import HeadPattern

        require_number(self.name, "streaming_share", self.streaming_share, 0.0, 1.0)
        require_int(self.name, "sinks", self.sinks, 0)
        if self.pattern is not None and not isinstance(self.pattern, (str, HeadPattern)):
            raise PolicyConfigError(f"{self.name}: pattern must be None (shipped), a JSON path or a HeadPattern; "
                                    f"got {self.pattern!r}")

    def check(self, spec: BudgetSpec) -> None:
        if spec.budget is not None and self.sinks > spec.budget:
            raise PolicyConfigError(f"{spec.name}: sinks ({self.sinks}) must not exceed budget ({spec.budget}); "
                                    f"allowed sinks range is [0, {spec.budget}]")

    def bind(self, model: torch.nn.Module) -> HeadSplit:
        """A copy holding the streaming mask ``(layers, kv_heads)`` of ``model``'s pattern (checked against it)."""
        from kvsieve.gates.head_pattern import HeadPattern, load_pattern, pretrained_pattern

        if isinstance(self.pattern, HeadPattern):
            loaded = self.pattern
        elif isinstance(self.pattern, str):
            loaded = load_pattern(self.pattern)
        else:
            loaded = pretrained_pattern(model)
        loaded.check_model(model, f"{self.name}: pattern")
        bound = replace(self)
        object.__setattr__(bound, "_streaming", loaded.streaming_mask(self.streaming_share))
        return bound

    def streaming_heads(self, layer_idx: int, heads: int, device: torch.device) -> torch.Tensor:
        """``(heads,)`` True for the streaming heads of a layer (``heads`` may be the query heads: expand_gqa)."""
        mask: torch.Tensor | None = getattr(self, "_streaming", None)
        if mask is None:
            raise RuntimeError(f"{self.name}: no head pattern bound; build the cache with KVCache(model, ...)")
        row = mask[layer_idx]
        if heads != row.shape[0]:
            row = row.repeat_interleave(heads // row.shape[0])
        return row.to(device)

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return step.view.positions.float().clone()

    def protect(self, scores: torch.Tensor, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        streaming = self.streaming_heads(step.layer_idx, scores.shape[1], scores.device).view(1, -1, 1)
        offsets = torch.arange(scores.shape[-1], device=scores.device).view(1, 1, -1)
        keep = ~streaming | (offsets < self.sinks)
        scores = scores.masked_fill(keep, math.inf)
        return scores.masked_fill(~step.entry_valid(), -math.inf)


PRESETS = (
    Preset("duo_attention", "DuoAttention: half the KV heads (lowest retrieval scores) keep 16 sinks + recent "
           "entries, the others everything", scorer=HeadSplit()),
)
