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
can still be evicted. A quantized entry keeps its scorer's per-entry side data (H2O's accumulator, KVzip's
reconstruction score, retention gates) in its tier, so any scorer and any allocator (a global budget
included) compose with this action, and so do decoding-time selectors (Quest, SparQ, RocketKV's hybrid sparse
attention, exact top-k): their pages, value sums and subsets are those of the combined view, every held entry
in position order with quantized ones dequantized, and their measured traffic counts each selected entry as
held (a quantized one its share of its group's codes, steps and minimums).
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
from kvsieve.ops.precision_plan import group_aware_plan
from kvsieve.ops.quantize import SUPPORTED_BITS, bytes_per_entry
from kvsieve.parts.actions.base import Action
from kvsieve.parts.schedules import Decode
from kvsieve.parts.scorers.restkv import OutputReconstruction
from kvsieve.parts.scorers.streaming_llm import Sinks


@dataclass(frozen=True)
class Quantize(Action):
    """Keep the plan's best entries in the model dtype and store the others at lower precision (see the module).

    ``bits`` may name several tiers in decreasing precision (``(4, 2)``) with one ``low_share`` each: the
    next-best entries after the full-precision ones go to the first tier, the next ones to the second...
    """

    name: ClassVar[str] = "quantize"
    #: Entries move into quantized tiers (every part reads them through the combined view).
    quantizes: ClassVar[bool] = True
    #: What ``kvsieve list`` says a policy with this action does.
    effect: ClassVar[str] = "quantizes"
    bits: int | tuple[int, ...] = 2
    group: int = 32
    value_group: int = 32
    low_share: float | tuple[float, ...] | None = None

    @property
    def tier_bits(self) -> tuple[int, ...]:
        return self.bits if isinstance(self.bits, tuple) else (self.bits,)

    @property
    def shares(self) -> tuple[float, ...]:
        """The share of the byte budget each low tier gets (mixed regime)."""
        if self.low_share is None:
            return ()
        return self.low_share if isinstance(self.low_share, tuple) else (self.low_share,)

    def validate(self) -> None:
        bits = self.tier_bits
        if not bits or any(b not in SUPPORTED_BITS for b in bits) or list(bits) != sorted(set(bits), reverse=True):
            raise PolicyConfigError(f"{self.name}: bits must be one of {SUPPORTED_BITS}, or several of them in "
                                    f"decreasing order such as (4, 2); got {self.bits!r}")
        require_int(self.name, "group", self.group, 1, 4096)
        require_int(self.name, "value_group", self.value_group, 1, 4096)
        if self.low_share is None:
            if len(bits) > 1:
                raise PolicyConfigError(f"{self.name}: several tiers (bits={self.bits!r}) need a low_share for "
                                        "each (the KIVI regime, low_share=None, has one)")
            return
        shares = self.shares
        if len(shares) != len(bits):
            raise PolicyConfigError(f"{self.name}: give one low_share per tier of bits={self.bits!r}; got "
                                    f"{self.low_share!r}")
        for share in shares:
            require_number(self.name, "low_share", share, 0.0, 1.0, low_open=True)
        if sum(shares) > 1.0:
            raise PolicyConfigError(f"{self.name}: the low_share values must sum to at most 1; got {self.low_share!r}")

    def check_model(self, config: object, info: object) -> None:
        """``value_group`` must divide the head size (values are grouped along channels); a group larger than
        the head is the whole head (one step and minimum per token)."""
        head_dim = getattr(info, "head_dim", None)
        if isinstance(head_dim, int) and self.value_group < head_dim and head_dim % self.value_group:
            raise PolicyConfigError(f"{self.name}: value_group must divide the model's head size {head_dim}; "
                                    f"got {self.value_group}")

    def split(self, counts: torch.Tensor, protected: torch.Tensor, head_dim: int, element: int
              ) -> list[torch.Tensor]:
        """Per head, entries kept in full precision and then in each low tier (mixed regime), from the budget
        ``counts`` in full-entry units and the number of ``protected`` entries."""
        full_bytes = 2 * head_dim * element
        budget = counts.double()
        full = torch.floor(budget * (1.0 - sum(self.shares))).long()
        full = torch.minimum(torch.maximum(full, protected), counts)
        spare = (counts - full).double() / max(sum(self.shares), 1e-12)  # what the low tiers share
        out = [full]
        for bits, share in zip(self.tier_bits, self.shares, strict=True):
            low_bytes = bytes_per_entry(head_dim, bits, min(self.value_group, head_dim), self.group)
            low = torch.floor(spare * share * full_bytes / low_bytes).long()
            out.append(low - low % self.group)  # whole groups: a partial group would cost a group's bytes
        return out

    def plan(self, scores: torch.Tensor, counts: torch.Tensor, step: LayerStep) -> Plan:
        lengths = step.lengths()
        if self.low_share is not None:
            return self._mixed_plan(scores, counts, step)
        bands, kept = [counts], lengths
        width = int(kept.max()) if kept.numel() else 0
        batch, heads, length = scores.shape
        flat = scores.reshape(batch * heads, length)
        top = torch.topk(flat, width, dim=-1, sorted=True).indices
        rank = torch.arange(width, device=scores.device)[None, :]
        filler = rank >= kept.reshape(-1, 1)
        tiers = torch.zeros_like(rank).expand(batch * heads, -1).clone()
        edge = torch.zeros_like(counts).reshape(-1, 1)
        for band in bands:
            edge = edge + band.reshape(-1, 1)
            tiers += (rank >= edge).long()
        top = top.masked_fill(filler, length)
        order = torch.sort(top, dim=-1)
        return Plan(order.values, kept.cpu().reshape(-1), tiers=torch.gather(tiers, 1, order.indices))

    def _mixed_plan(self, scores: torch.Tensor, counts: torch.Tensor, step: LayerStep) -> Plan:
        """The mixed regime, group-aware (:mod:`kvsieve.ops.precision_plan`): the best entries in the model dtype,
        then per tier the groups its bytes buy — existing groups and new ones compete — and the rest evicted.
        At every compaction a head holds at most its byte budget, whatever the schedule."""
        store = step.store
        protected = torch.isposinf(scores).sum(dim=-1)
        bands = self.split(counts, protected, store.head_dim, store.keys.element_size())
        batch, heads, length = scores.shape
        segments = batch * heads
        origin, slot = store.origins()
        keep, target = group_aware_plan(
            scores.reshape(segments, length), origin.reshape(segments, length), slot.reshape(segments, length),
            bands[0].reshape(-1), [(band // self.group).reshape(-1) for band in bands[1:]], self.group,
            quantized=any(not tier.empty for tier in store.tiers),
        )
        kept = keep.sum(dim=1)
        order = torch.where(keep, torch.arange(length, device=keep.device)[None, :], length)
        local = torch.sort(order, dim=1).values[:, : int(kept.max()) if kept.numel() else 0]
        tiers = torch.gather(target, 1, local.clamp(max=max(length - 1, 0)))
        return Plan(local, kept.cpu(), tiers=tiers)

    def apply(self, store: LayerStore, plan: Plan) -> None:
        if not store.tiers:
            for bits in self.tier_bits:
                store.add_tier(bits, self.group, min(self.value_group, store.head_dim))
        store.keep(plan.keep, plan.counts, plan.tiers)

PRESETS = (
    Preset("kivi", "KIVI: every entry but the most recent `budget` (full-precision residual) quantized, keys per "
           "channel, values per token, 2 bits, groups of 32; nothing evicted", scorer=Sinks(sinks=0),
           action=Quantize(bits=2, group=32, value_group=32), schedule=Decode(buffer=31)),
    Preset("mixed", "mixed precision at equal bytes: half of a `budget`-entry byte budget keeps the best restkv "
           "entries in full precision, half buys 2-bit entries for the next ones, the rest evicted",
           scorer=OutputReconstruction(), action=Quantize(bits=2, low_share=0.5)),
)
