"""``ems`` scorer — Global-Local score (Li et al., 2024, "EMS: Adaptive Evict-then-Merge Strategy for Head-wise
KV Cache Compression Based on Global-Local Importance", arXiv:2412.08521, Sec. 3.3, Eq. 2).

* ``s_glo`` = attention accumulated over **every** query so far (the prompt's, blockwise through the
  kernel's column sums — never N×N — then each decoding query's row), kept per entry as side data
  ``ems_global``, like H2O's accumulator;
* ``s_loc`` = ``s_loc^past + s_loc^cur`` (Sec. 3.3): at a prompt, ``past`` = the attention of its last
  ``window`` queries and ``cur`` = 0; at decoding each new row is added to ``cur`` and once ``cur``
  holds ``window`` rows it becomes ``past`` and restarts at zero, so ``s_loc`` covers the last
  ``window … 2·window − 1`` queries (a forward of fewer than ``window`` queries — a short prompt, or text
  streamed in chunks — is treated like that many decoding rows: they join ``cur``, swapped once it holds
  ``window`` or more) (side data ``ems_local_past``, ``ems_local_cur``, and
  ``ems_local_rows`` — how many rows ``cur`` holds, the same value stored on every entry so that it moves
  with the entries and survives copies, batch selection and compaction);
* Eq. 2: ``s = max(s_glo · mean(s_loc)/mean(s_glo), s_loc)`` element-wise, the means over the head's held
  entries (the paper's ``Σ/N``), then mean pooling with ``kernel_size`` (Sec. 4.2, "to avoid extracting
  fragmented information"; 7 in the paper) — zero-padded average, as SnapKV's reference pooling;
* the newest ``window`` entries are always kept (``+inf``; the paper's ``L_win`` local tokens).

Readings (not fixed by the paper): scores are reduced over each GQA group by the mean *before* Eq. 2 (one
selection per KV head; the paper's models are mostly MHA); the protected window's own scores are zeroed
before pooling so their self-attention does not leak into the prefix (SnapKV's reference code does the
same); a merged centre keeps its own accumulated scores (the merged tokens' past scores are not added —
its future rows carry the ``log n`` bias, so it collects ``n`` tokens' worth of attention from then on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.store import SideSpec
from kvsieve.core.part import PolicyConfigError, require_int, require_odd_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import COLUMN_SUMS, WINDOW_ROWS, LayerStep
from kvsieve.ops.gqa import reduce_groups
from kvsieve.ops.pooling import pool_scores
from kvsieve.parts.actions.evict_merge import EvictThenMerge
from kvsieve.parts.actions.evict_merge_pos import EvictThenMergePos
from kvsieve.parts.schedules import Decode
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer

GLOBAL = "ems_global"
LOCAL_PAST = "ems_local_past"
LOCAL_CUR = "ems_local_cur"
LOCAL_ROWS = "ems_local_rows"


def global_local(s_glo: torch.Tensor, s_loc: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Eq. 2 over the last axis: ``max(s_glo · mean(s_loc)/mean(s_glo), s_loc)`` with means over ``valid`` entries.

    A head whose ``s_glo`` sums to zero (nothing attended yet) uses ``s_loc`` alone. In float64 (the result too): the
    scores :meth:`GlobalLocal.raw` rounds to float32 once are then the same in any implementation summing in float64
    (``native/merge.c``), where float32 sums in two orders leave near ties to rounding.
    """
    g = s_glo.double().masked_fill(~valid, 0.0)
    loc = s_loc.double().masked_fill(~valid, 0.0)
    ratio = loc.sum(-1, keepdim=True) / g.sum(-1, keepdim=True)  # the 1/N of both means cancels
    ratio = torch.where(torch.isfinite(ratio), ratio, torch.zeros_like(ratio))
    return torch.maximum(g * ratio, loc)


@dataclass(frozen=True)
class GlobalLocal(Scorer):
    """EMS's Global-Local score (Eq. 2) with mean pooling; keeps the local window; any schedule."""

    name: ClassVar[str] = "ems"
    SCHEDULES: ClassVar[tuple[str, ...]] = ALL_SCHEDULES
    NEEDS: ClassVar[frozenset[str]] = frozenset({COLUMN_SUMS, WINDOW_ROWS})
    SIDE: ClassVar[tuple[SideSpec, ...]] = (
        SideSpec(GLOBAL), SideSpec(LOCAL_PAST), SideSpec(LOCAL_CUR), SideSpec(LOCAL_ROWS),
    )
    window: int = 32
    kernel_size: int = 7
    #: False: the local score alone (``s = s_loc``), the global-term ablation (the paper's "w/o global")
    use_global: bool = True

    def validate(self) -> None:
        require_int(self.name, "window", self.window, 1)
        require_odd_int(self.name, "kernel_size", self.kernel_size)
        if not isinstance(self.use_global, bool):
            raise PolicyConfigError(f"{self.name}: use_global must be True or False; got {self.use_global!r}")

    def observe(self, step: LayerStep) -> dict[str, torch.Tensor]:
        extras = step.view.extras
        valid = step.entry_valid()
        heads = step.kv_heads
        glo = reduce_groups(step.all_column_sums(), heads, "mean")
        past, cur, rows = extras[LOCAL_PAST].float(), extras[LOCAL_CUR].float(), extras[LOCAL_ROWS].float()
        if step.q_len >= self.window:  # a prompt (or a block of one): past = its last `window` queries, cur restarts
            local = reduce_groups(step.window_column_sums(self.window), heads, "mean")
            return {GLOBAL: glo, LOCAL_PAST: local - past, LOCAL_CUR: -cur, LOCAL_ROWS: -rows}
        # decoding (and chunks shorter than the window, e.g. streamed text): the rows join `cur`
        held = rows.masked_fill(~valid, 0.0).amax(dim=-1, keepdim=True) + step.q_len  # new entries hold 0
        new_cur = cur + glo
        swap = held >= self.window
        new_past = torch.where(swap, new_cur, past)
        new_cur = torch.where(swap, torch.zeros_like(new_cur), new_cur)
        new_rows = torch.where(swap, torch.zeros_like(held), held).expand_as(rows)
        return {GLOBAL: glo, LOCAL_PAST: new_past - past, LOCAL_CUR: new_cur - cur, LOCAL_ROWS: new_rows - rows}

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        extras = step.view.extras
        valid = step.entry_valid()
        s_loc = extras[LOCAL_PAST].float() + extras[LOCAL_CUR].float()
        scores = (global_local(extras[GLOBAL], s_loc, valid) if self.use_global
                  else s_loc.double().masked_fill(~valid, 0.0))
        lengths = step.lengths()
        offsets = torch.arange(scores.shape[-1], device=scores.device)
        in_window = offsets.view(1, 1, -1) >= (lengths - self.window).unsqueeze(-1)
        scores = scores.masked_fill(in_window | ~valid, 0.0)
        # pooled in float64 and rounded once: native/merge.c's scores bit for bit (global_local)
        return pool_scores(scores, self.kernel_size, "avgpool", dtype=torch.float64).float()


PRESETS = (
    Preset("ems", "EMS: Global-Local score (w=32, kernel 7), head-wise evict-then-merge (γ=4, τ=0.6), prefill and "
           "decoding", scorer=GlobalLocal(), action=EvictThenMerge(), schedule=Decode()),
    Preset("ems_pos", "EMS w. pos: ems plus a position look-up table, centres expanded to their positions at "
           "attention time", scorer=GlobalLocal(), action=EvictThenMergePos(), schedule=Decode()),
)
