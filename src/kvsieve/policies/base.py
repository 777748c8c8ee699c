"""The policy contract: which entries matter (score), how many each head keeps (budget), when to act.

A policy is a frozen dataclass whose fields are the paper's hyper-parameters; ``str(policy)``
reproduces it. The cache calls, for every attention layer and forward call:

1. :meth:`Policy.observe` — update per-entry side data (e.g. H2O's accumulated attention);
2. :meth:`Policy.decode_attention` — optionally replace the attention output at decoding
   (selection methods such as ``exact_topk``);
3. when the schedule fires, :meth:`Policy.score` and :meth:`Policy.allocate`, and the cache keeps
   the top-scoring entries per head (exact copies, original positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep

SCHEDULES = ("prefill", "decode", "blockwise")


class PolicyConfigError(ValueError):
    """A policy parameter is out of range or a policy/schedule combination cannot work."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Policy:
    """Base class of every KV-cache policy.

    Attributes:
        budget: entries kept per (layer, KV head) — an int ≥ 1. Exclusive with ``ratio``.
        ratio: fraction of held entries removed at each compression, in ``[0, 1)``.
        schedule: ``"prefill"`` compresses once after each prompt (every multi-token forward);
            ``"decode"`` also compresses during generation whenever a head holds more than
            ``budget + buffer`` entries (``buffer`` 0 = evict one entry every step).
            ``"blockwise"`` (CAOTE's setting, Goel et al. 2025, Sec. 3) feeds each prompt in blocks of
            ``block_size`` tokens and evicts back to ``budget`` after every block, so a head never holds
            more than ``budget + block_size`` entries, then evicts at every decoding step like ``decode``.
        buffer: extra entries tolerated before a decoding-time compression (amortises eviction).
        block_size: prompt block length ``m`` of the ``blockwise`` schedule.
    """

    name: ClassVar[str] = ""
    #: Schedules this policy can run under.
    schedules: ClassVar[tuple[str, ...]] = ("prefill",)
    #: False for policies that never delete entries (full cache, decoding-time selection).
    evicts: ClassVar[bool] = True
    #: Per-entry side data (float32 scalars) the policy keeps in the cache.
    extras: ClassVar[tuple[str, ...]] = ()
    #: Whether a budget/ratio must be given.
    needs_budget: ClassVar[bool] = True

    budget: int | None = None
    ratio: float | None = None
    schedule: str = "prefill"
    buffer: int = 0
    block_size: int = 128

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`PolicyConfigError` naming the parameter and its allowed range."""
        budget, ratio = self.budget, self.ratio
        if self.needs_budget:
            if budget is None and ratio is None:
                raise PolicyConfigError(f"{self.name}: give budget (int ≥ 1, entries per head) or ratio in [0, 1)")
            if budget is not None and ratio is not None:
                raise PolicyConfigError(f"{self.name}: give either budget or ratio, not both")
        if budget is not None and (not is_int(budget) or budget <= 0):
            raise PolicyConfigError(f"{self.name}: budget must be an int ≥ 1 (entries per head); got {budget!r}")
        if ratio is not None and (
            not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0.0 <= ratio < 1.0
        ):
            raise PolicyConfigError(f"{self.name}: ratio must be a float in [0, 1); got {ratio!r}")
        if self.schedule not in SCHEDULES:
            raise PolicyConfigError(f"{self.name}: schedule must be one of {SCHEDULES}; got {self.schedule!r}")
        if self.schedule not in self.schedules:
            raise PolicyConfigError(
                f"{self.name}: schedule {self.schedule!r} cannot work with this policy; "
                f"supported schedules: {self.schedules}"
            )
        if self.schedule in ("decode", "blockwise") and self.needs_budget and budget is None:
            raise PolicyConfigError(
                f"{self.name}: schedule {self.schedule!r} needs an absolute budget "
                "(a ratio of a growing cache is undefined)"
            )
        if not is_int(self.block_size) or self.block_size < 1:
            raise PolicyConfigError(f"{self.name}: block_size must be an int ≥ 1; got {self.block_size!r}")
        if not is_int(self.buffer) or self.buffer < 0:
            raise PolicyConfigError(f"{self.name}: buffer must be an int ≥ 0; got {self.buffer!r}")
        window = getattr(self, "window", None)
        if window is not None:
            if not is_int(window) or window < 0:
                raise PolicyConfigError(f"{self.name}: window must be an int ≥ 0; got {window!r}")
            if budget is not None and window > budget:
                raise PolicyConfigError(
                    f"{self.name}: window ({window}) must not exceed budget ({budget}); "
                    f"allowed window range is [0, {budget}]"
                )

    def describe(self) -> dict[str, object]:
        """The policy's name and parameters (used by ``kvsieve list`` and result files)."""
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def __str__(self) -> str:
        params = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"{self.name}({params})"

    # ------------------------------------------------------------------ budget
    def target(self, lengths: torch.Tensor, layer_idx: int, num_layers: int) -> torch.Tensor:
        """Entries to keep per (batch, KV head) given the ``lengths`` held now."""
        if self.budget is not None:
            return torch.full_like(lengths, self.layer_budget(layer_idx, num_layers))
        assert self.ratio is not None
        return torch.ceil(lengths.double() * (1.0 - self.ratio)).long()

    def layer_budget(self, layer_idx: int, num_layers: int) -> int:
        """Per-head budget of one layer (uniform by default; PyramidKV overrides)."""
        assert self.budget is not None
        return self.budget

    def should_compress(self, step: LayerStep) -> bool:
        """Whether the schedule fires after this forward of this layer."""
        if not self.evicts:
            return False
        if self.schedule == "prefill":
            return not step.is_decoding
        budget = self.layer_budget(step.layer_idx, step.info.num_layers)
        if not step.is_decoding:
            # decode: compress the prompt once; blockwise: back to budget after every block.
            return self.schedule == "decode" or bool((step.store.length > budget).any())
        return bool((step.store.length > budget + self.buffer).any())

    # ------------------------------------------------------------------ hooks
    def observe(self, step: LayerStep) -> None:
        """Update per-entry side data after every forward (default: nothing)."""

    def decode_attention(self, step: LayerStep) -> torch.Tensor | None:
        """Replace the attention output ``(batch, q, q_heads, d)`` at decoding (default: no)."""
        return None

    def score(self, step: LayerStep) -> torch.Tensor:
        """Scores ``(batch, kv_heads, L)`` of the dense view's entries: higher = keep."""
        raise NotImplementedError(f"{type(self).__name__} must implement score()")

    def allocate(self, scores: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Entries kept per (batch, KV head): the target, never more than held (default)."""
        lengths = step.lengths()
        target = self.target(lengths.cpu(), step.layer_idx, step.info.num_layers).to(lengths.device)
        return torch.minimum(target, lengths)


def protect_recent(scores: torch.Tensor, step: LayerStep, recent: int | torch.Tensor) -> torch.Tensor:
    """Give +inf to the ``recent`` newest entries of each head and -inf to padding slots."""
    lengths = step.lengths()
    offsets = torch.arange(scores.shape[-1], device=scores.device)
    recent_t = torch.as_tensor(recent, device=scores.device)
    is_recent = offsets.view(1, 1, -1) >= (lengths - recent_t).unsqueeze(-1)
    out = scores.float().masked_fill(is_recent, math.inf)
    return out.masked_fill(~step.entry_valid(), -math.inf)
