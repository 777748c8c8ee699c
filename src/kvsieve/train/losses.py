"""Losses of retention-gate training (DBTrimKV, Bui et al., 2026, arXiv:2605.09649, Sec. 2.2 Eqs. 3–5,
Sec. 4.1).

* quality: ``KL(teacher ‖ student)`` of the next-token distributions (teacher: the frozen model with plain
  attention; student: the same model with retention-gated attention), averaged over the scored positions;
* capacity: ``mean_t max(0, Σ_{i≤t} β_i^{t−i} − M)`` — per (layer, KV head) against its budget ``M``
  (TrimKV, Eq. 4), or over the sum of all layers and heads against the global budget ``L·H·M``
  (DBTrimKV, Sec. 4.1).

Reading: the paper's ``λ`` was lost in extraction (the authors' released configs default to 1.0); kvsieve
divides the overflow by the budget (``M`` per head, ``L·H·M`` globally) so ``λ`` weighs a *relative*
overflow on the same scale for both variants and any sequence length, and averages over every query
position ``t`` (and, per head, over layers and heads).
"""

from __future__ import annotations

import torch


def kl_teacher_student(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """``mean_positions Σ_v p_T(v)·(log p_T(v) − log p_S(v))`` over ``(..., vocab)`` logits (float32)."""
    teacher = torch.log_softmax(teacher_logits.float(), dim=-1)
    student = torch.log_softmax(student_logits.float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(dim=-1).mean()


def capacity_loss(masses: list[torch.Tensor], budget: int, scope: str) -> torch.Tensor:
    """Relative overflow of the retention mass; ``masses``: one ``(B, Hkv, N)`` per layer.

    ``scope="head"`` (TrimKV): ``mean_{l,h,t} max(0, S_{l,h}(t) − M) / M``;
    ``scope="global"`` (DBTrimKV): ``mean_t max(0, Σ_{l,h} S_{l,h}(t) − L·H·M) / (L·H·M)``.
    """
    if budget < 1:
        raise ValueError(f"budget must be an int ≥ 1; got {budget!r}")
    stacked = torch.stack(masses, dim=1)  # (B, L, Hkv, N)
    if scope == "head":
        return (torch.relu(stacked - budget) / budget).mean()
    if scope == "global":
        total_budget = budget * stacked.shape[1] * stacked.shape[2]
        return (torch.relu(stacked.sum(dim=(1, 2)) - total_budget) / total_budget).mean()
    raise ValueError(f"scope must be 'head' or 'global'; got {scope!r}")
