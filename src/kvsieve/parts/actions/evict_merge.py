"""``ems`` action — head-wise evict-then-merge with a zero class (EMS, Li et al., 2024, arXiv:2412.08521,
Sec. 4.2, Eq. 5, App. A).

Per head, ranking the entries by the scorer's score (the Global-Local score of :mod:`.global_local`, but
any scorer works):

* the protected entries (``+inf``: the local window ``L_win``) are always kept;
* the other kept entries — the top ``B − L_win`` of a head keeping ``B`` — are the **class centres**;
* the next ``N_tbm = ⌊(γ − 1)·B⌋`` are **to be merged** (TBM; ``γ`` is the merge magnification factor,
  ``γ = (N_budget + N_tbm)/N_budget``; ``γ = 1`` evicts only, ``γ = inf`` makes every other entry TBM);
* the rest are evicted (first level of eviction).

Each TBM entry ``i`` goes to ``d_i = argmax_c R_{i,c}`` over the centres with the redundancy
``R_{i,c} = cos(k_i, k_c)·cos(v_i, v_c)`` (Sec. 4.1) computed on **raw** keys — un-rotated at their stored
positions with the layer's rotary table (:mod:`kvsieve.ops.rope`) — and is merged into it only if
``R_{i,d_i} > τ`` (the paper's "exceeding"/"above τ", App. B; ``R`` is clamped to ``[-1, 1]`` so ``τ = 1``
is exactly pure eviction by the same score, as Table 6 reads it); otherwise it joins the zero class
(evicted). The issue text says ``R ≥ τ``: the two differ only on exact ties. ``R`` is computed in float64
(:func:`~kvsieve.ops.rope.unrotate_exact`: the raw keys' directions from the stored elements and float64 cos/sin):
the target and the comparison with ``τ`` are then the same in any implementation that sums in float64 (two orders of
summation agree to ~1e-15), where float32 ones differ by ~1e-6 and would pick either of two centres that nearly tie —
which happens: a layer whose keys and values are nearly collinear gives redundancies of 0.99999x within 1e-6 of each
other. Centres within :data:`REDUNDANCY_TIE` (1e-12) of the best are one tie, broken by entry order (the first).
``native/merge.c`` screens in float32 and takes the float64 redundancy where the float32 one is too close.

Merge (executed by :func:`kvsieve.parts.actions.merge.merge_kept`): weights are the scorer's scores
(``w_i`` of a TBM entry, ``w_c`` of the centre itself; floored at ``1e-12`` so a zero score cannot zero
a merge). Keys, in raw space: ``k = normalize(Σ w·k/‖k‖) · (Σ w‖k‖ / Σ w)`` — the weighted mean
direction with the weighted mean norm kept apart (Sec. 4.2: "preserve the norm of key tokens … only merge
the normalized keys"), then re-rotated at the centre's position; values directly:
``v = Σ w·v / Σ w``. The centre's ``merge_count`` adds the merged entries' counts, and every attention
path adds ``log(count)`` to its logit, so a centre of ``n`` tokens counts ``n`` times.

Decoding (Sec. 3.3, App. A) needs nothing else: under ``Decode(buffer=0)`` a head holding ``B + 1``
entries releases its oldest local entry into the candidates, and the least important candidate becomes
the one TBM entry (merged or evicted), so every head stays at ``B``. Reading: the released entry
competes with the centres by its score (the issue's "candidate centre"); App. A's wording admits it
unconditionally and demotes the least important *old* centre — the two differ only when the released
entry itself scores lowest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.core.part import PolicyConfigError, is_number, require_number
from kvsieve.core.plan import Plan
from kvsieve.core.step import LayerStep
from kvsieve.models.architectures import ModelInfo
from kvsieve.ops.rope import rotary_table, unrotate_exact
from kvsieve.parts.actions.merge import Merge, RawKeyPlan

#: Smallest merge weight (a zero score must not cancel a merge's normalisation).
MIN_WEIGHT = 1e-12
#: Redundancies within this of a TBM entry's best are one tie and the first of those centres (in entry order) is its
#: target: duplicates of a token hold the same raw key and value but for rounding (in float32 they tie at 1 − 1e-15),
#: so which one ``max`` picks would be rounding's, and two implementations' choices would differ.
REDUNDANCY_TIE = 1e-12


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=MIN_WEIGHT)


@dataclass(frozen=True)
class EvictThenMerge(Merge):
    """EMS's evict-then-merge: centres, to-be-merged entries (γ), zero class below τ."""

    name: ClassVar[str] = "evict_merge"
    gamma: float = 4.0
    tau: float = 0.6

    def validate(self) -> None:
        if not is_number(self.gamma) or not (self.gamma >= 1.0):
            raise PolicyConfigError(f"{self.name}: gamma must be a number ≥ 1 (or inf); got {self.gamma!r}")
        require_number(self.name, "tau", self.tau, -1.0, 1.0)

    def check_model(self, config: object, info: ModelInfo) -> None:
        """Refuse, before any work, a model whose rotary embedding cannot be un-rotated (raw keys, Sec. 4.1)."""
        for layer in info.managed_layers:
            rotary_table(config, layer)

    def plan(self, scores: torch.Tensor, counts: torch.Tensor, step: LayerStep) -> Plan:
        base = super(Merge, self).plan(scores, counts, step)
        plan = RawKeyPlan(base.keep, base.counts, rotary=rotary_table(step.module.config, step.layer_idx,
                                                                       scores.device))
        self.assign(plan, scores, step)
        return plan

    def tbm_counts(self, counts: torch.Tensor, length: int) -> torch.Tensor:
        """``⌊(γ − 1)·B⌋`` entries to be merged per head keeping ``B`` (all the rest for ``γ = inf``)."""
        if math.isinf(self.gamma):
            return torch.full_like(counts, length)
        return torch.floor(counts.double() * (float(self.gamma) - 1.0)).long()

    def assign(self, plan: Plan, scores: torch.Tensor, step: LayerStep) -> None:
        assert isinstance(plan, RawKeyPlan) and plan.rotary is not None
        batch, heads, length = scores.shape
        segs = batch * heads
        device = scores.device
        flat = scores.reshape(segs, length)
        host_counts = plan.counts  # host tensor: the widths below need no device round trip
        host_tbm = torch.minimum(self.tbm_counts(host_counts, length), length - host_counts)
        t_max = int(host_tbm.max()) if segs else 0
        if t_max <= 0:
            return
        counts, n_tbm = host_counts.to(device), host_tbm.to(device)
        view = step.view
        dim = view.keys.shape[-1]
        keys = view.keys.reshape(segs, length, dim)
        values = view.values.reshape(segs, length, dim)
        positions = view.positions.reshape(segs, length)
        # TBM: ranks [B, B + N_tbm) of each head's descending order, real entries only
        width = min(length, int(host_counts.max()) + t_max)
        order = torch.topk(flat, width, dim=-1, sorted=True).indices
        rank = counts[:, None] + torch.arange(t_max, device=device)[None, :]
        tbm = order.gather(1, rank.clamp(max=width - 1))
        tbm_score = flat.gather(1, tbm)
        is_tbm = (rank < counts[:, None] + n_tbm[:, None]) & (rank < width) & torch.isfinite(tbm_score)
        # centres: kept entries that are not protected
        keep = plan.keep.to(device)
        keep_idx = keep.clamp(max=length - 1)
        kept_score = flat.gather(1, keep_idx)
        slot = torch.arange(keep.shape[1], device=device)[None, :]
        is_centre = (slot < counts[:, None]) & torch.isfinite(kept_score)

        def raw_unit_keys(idx: torch.Tensor) -> torch.Tensor:
            k = keys.gather(1, idx[..., None].expand(-1, -1, dim))
            return _unit(unrotate_exact(k, positions.gather(1, idx), plan.rotary))  # type: ignore[arg-type]

        def unit_values(idx: torch.Tensor) -> torch.Tensor:
            return _unit(values.gather(1, idx[..., None].expand(-1, -1, dim)).double())

        redundancy = torch.matmul(raw_unit_keys(tbm), raw_unit_keys(keep_idx).transpose(1, 2))
        redundancy = redundancy * torch.matmul(unit_values(tbm), unit_values(keep_idx).transpose(1, 2))
        redundancy = redundancy.clamp(-1.0, 1.0).masked_fill(~is_centre[:, None, :], -math.inf)
        best = redundancy.max(dim=-1).values
        # the first centre within REDUNDANCY_TIE of the best: a token's duplicates, identical but for rounding, tie
        target = (redundancy >= (best - REDUNDANCY_TIE).unsqueeze(-1)).int().argmax(dim=-1)
        merged = is_tbm & (best > self.tau)
        plan.merge_source = torch.where(merged, tbm, torch.full_like(tbm, -1))
        plan.merge_target = target
        plan.merge_weight = tbm_score.float().clamp(min=MIN_WEIGHT).masked_fill(~merged, 0.0)
        plan.keep_weight = kept_score.float().masked_fill(~is_centre, 1.0).clamp(min=MIN_WEIGHT)
