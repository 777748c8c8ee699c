"""Quantize: the entries a plan would evict are stored at low precision instead (a third action).

Two regimes, one action:

* **KIVI** (``low_share=None``; Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
  Cache", arXiv:2402.02750): nothing is evicted. The plan's ``counts`` entries per head (the budget: with a
  recency scorer, the most recent ones — KIVI's full-precision residual) stay in the model dtype and every
  other entry is quantized, keys per channel in groups of ``group`` tokens and values per token in groups of
  ``value_group`` channels (:mod:`kvsieve.ops.quantize`). Under a ``decode`` schedule with
  ``buffer = group − 1`` the residual grows to ``budget + group − 1`` entries and then its oldest ``group``
  entries become one quantized group, as KIVI's streaming cache does (KIVI flushes its whole residual of
  ``R`` tokens at once; here between ``budget`` and ``budget + group − 1`` stay in full precision).
* **Mixed precision** (``low_share = f``; the idea of MiKV, Yang et al., 2024, "No Token Left Behind",
  arXiv:2402.18096, with any score): the budget is read as bytes — ``budget`` full-precision entries' worth
  per head. ``(1 − f)`` of it keeps the best-scored entries (the scorer's protected ones first) in the
  model dtype, ``f`` of it buys ``bits``-bit entries for the next ones in score order, and the rest are
  evicted. A head so holds about the bytes of ``budget`` full entries, and ``4–8×`` more entries than
  eviction alone at 2–4 bits.

Entries already quantized stay in their tier (they are never dequantized back to full precision); they
can still be evicted. Quantized entries carry no per-entry side data, so scorers that keep side data
(H2O's accumulator, EMS, retention gates) are refused with this action, as are selectors and global
allocators (their decoding-time and cross-layer paths do not read tiers yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.store import LayerStore
from kvsieve.core.part import PolicyConfigError, require_int, require_number
from kvsieve.core.plan import Plan
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.ops.quantize import SUPPORTED_BITS, bytes_per_entry
from kvsieve.parts.actions.base import Action
from kvsieve.parts.schedules import Decode
from kvsieve.parts.scorers.restkv import OutputReconstruction
from kvsieve.parts.scorers.streaming_llm import Sinks


@dataclass(frozen=True)
class Quantize(Action):
    """Keep the plan's best entries in the model dtype and store the others at ``bits`` bits (see the module)."""

    name: ClassVar[str] = "quantize"
    #: Entries move into quantized tiers (the policy then refuses parts that cannot read tiers yet).
    quantizes: ClassVar[bool] = True
    #: What ``kvsieve list`` says a policy with this action does.
    effect: ClassVar[str] = "quantizes"
    bits: int = 2
    group: int = 32
    value_group: int = 32
    low_share: float | None = None

    def validate(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise PolicyConfigError(f"{self.name}: bits must be one of {SUPPORTED_BITS}; got {self.bits!r}")
        require_int(self.name, "group", self.group, 1, 4096)
        require_int(self.name, "value_group", self.value_group, 1, 4096)
        if self.low_share is not None:
            require_number(self.name, "low_share", self.low_share, 0.0, 1.0, low_open=True)

    def check_model(self, config: object, info: object) -> None:
        """``value_group`` must divide the head size (values are grouped along channels); a group larger than
        the head is the whole head (one step and minimum per token)."""
        head_dim = getattr(info, "head_dim", None)
        if isinstance(head_dim, int) and self.value_group < head_dim and head_dim % self.value_group:
            raise PolicyConfigError(f"{self.name}: value_group must divide the model's head size {head_dim}; "
                                    f"got {self.value_group}")

    def split(self, counts: torch.Tensor, protected: torch.Tensor, head_dim: int, element: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head: entries kept in full precision and entries kept at ``bits`` bits (mixed regime), from
        the budget ``counts`` in full-entry units and the number of ``protected`` entries."""
        full_bytes = 2 * head_dim * element
        low_bytes = bytes_per_entry(head_dim, self.bits, min(self.value_group, head_dim), self.group)
        assert self.low_share is not None
        full = torch.floor(counts.double() * (1.0 - self.low_share)).long()
        full = torch.minimum(torch.maximum(full, protected), counts)
        low = torch.floor((counts - full).double() * full_bytes / low_bytes).long()
        return full, low

    def plan(self, scores: torch.Tensor, counts: torch.Tensor, step: LayerStep) -> Plan:
        lengths = step.lengths()
        if self.low_share is None:
            full, kept = counts, lengths
        else:
            protected = torch.isposinf(scores).sum(dim=-1)
            full, low = self.split(counts, protected, step.store.head_dim, step.store.keys.element_size())
            kept = torch.minimum(full + low, lengths)
        width = int(kept.max()) if kept.numel() else 0
        batch, heads, length = scores.shape
        flat = scores.reshape(batch * heads, length)
        top = torch.topk(flat, width, dim=-1, sorted=True).indices
        rank = torch.arange(width, device=scores.device)[None, :]
        filler = rank >= kept.reshape(-1, 1)
        tiers = (rank >= full.reshape(-1, 1)).long()
        top = top.masked_fill(filler, length)
        order = torch.sort(top, dim=-1)
        return Plan(order.values, kept.cpu().reshape(-1), tiers=torch.gather(tiers, 1, order.indices))

    def apply(self, store: LayerStore, plan: Plan) -> None:
        if not store.tiers:
            store.add_tier(self.bits, self.group, min(self.value_group, store.head_dim))
        store.keep(plan.keep, plan.counts, plan.tiers)


PRESETS = (
    Preset("kivi", "KIVI: every entry but the most recent `budget` (full-precision residual) quantized, keys per "
           "channel, values per token, 2 bits, groups of 32; nothing evicted", scorer=Sinks(sinks=0),
           action=Quantize(bits=2, group=32, value_group=32), schedule=Decode(buffer=31)),
    Preset("mixed", "mixed precision at equal bytes: half of a `budget`-entry byte budget keeps the best restkv "
           "entries in full precision, half buys 2-bit entries for the next ones, the rest evicted",
           scorer=OutputReconstruction(), action=Quantize(bits=2, low_share=0.5)),
)
