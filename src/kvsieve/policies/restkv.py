"""``restkv`` — ReST-KV (Chen et al. 2025, "ReST-KV: Robust KV Cache Eviction with Layer-wise Output
Reconstruction and Spatial-Temporal Smoothing", ``papers/restkv.txt``).

Prefill-once, like SnapKV, over the same observation window (the last ``window`` prompt queries):

1. indicator per window query ``t``, query head ``h`` and held entry ``j`` (Eq. 7, exact single-entry
   removal error of the head's contribution to the layer output, App. A):
   ``I_t[j] = A[t,j] / (1 - A[t,j]) · ‖(o_t - v_j) W_O^h‖₂``; ablations: ``use_output_projection=False``
   gives ``A/(1-A)·‖o_t - v_j‖₂`` (METHODS.md's "w/o W_O"), ``indicator="vatp"`` gives ``A[t,j]·‖v_j‖₂``
   (Table 15, VATP) and ``indicator="attention"`` gives ``A[t,j]`` (Table 15 "Attention weights" = Table 3
   "w/o LOR", 33.95 in both);
2. temporal smoothing: EMA over the window queries in order, ``α = 0.3`` (Eq. 9); ``use_ema=False``
   takes the plain mean instead (Table 16 "Mean" = Table 3 "w/o EMA", 34.02 in both);
3. spatial smoothing: adaptive window (AWS, Eq. 10–13, ``β = 2000``) with ``B`` the head's budget,
   around a base kernel ``kernel_size`` (App. B: k = 5 for ReST-KV, 21 on RULER): ``W_s = k + 2⌊|ΔD|/β⌋``.
   **Differs from Eq. 11 as printed** (``W_s = 2⌊|ΔD|/β⌋ + 1``; ``kernel_size=1`` gives it exactly):
   printed, the window is 1 — no spatial smoothing — unless the important entries drift by ≥ β = 2000
   tokens, which on the default model's 2k–4k needle prompts made ReST-KV worse than SnapKV (answer
   log-likelihood −10.6 vs −4.2 at budget 256, 2k; ``docs/results/issue3``). Eq. 12's shift is rounded
   towards zero (see :func:`kvsieve.scores.smoothing.adaptive_window`).
   ``adaptive_smoothing=False`` uses SnapKV's avgpool with ``kernel_size`` (Table 16 "Avgpool";
   ``kernel_size=1`` there is Table 3's "w/o AWS" = Table 16 spatial "None");
4. GQA: mean over the query heads of each KV group (METHODS.md); the window is always kept (Eq. 8's Ω).

Only entries before the window (Eq. 8's ``n < t - S_w``) compete: window entries get 0 before smoothing
(as in SnapKV's reference code), so their own huge indicator does not leak into their neighbours.
Extra cost over SnapKV: ``o_t`` from the window rows already computed, the per-head ``d×d`` Gram of
``W_O^h`` and one ``(w×d)·(d×L)`` product per head — ``O(w·L·d + L·d²)`` like SnapKV's ``O(w·L·d)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.attention.step import LayerStep
from kvsieve.policies.base import Policy, PolicyConfigError, is_int, protect_recent
from kvsieve.policies.registry import register
from kvsieve.policies.snapkv import SnapKV
from kvsieve.scores.gqa import reduce_groups
from kvsieve.scores.pooling import pool_scores
from kvsieve.scores.reconstruction import output_gram, restkv_indicator, vatp_indicator
from kvsieve.scores.smoothing import adaptive_spatial_smoothing, ema_over_window, mean_over_window

INDICATORS = ("restkv", "vatp", "attention")


@register
@dataclass(frozen=True)
class RestKV(Policy):
    """Layer-wise output reconstruction indicator with EMA and adaptive-window smoothing; keeps the window."""

    name: ClassVar[str] = "restkv"
    schedules: ClassVar[tuple[str, ...]] = SnapKV.schedules
    window: int = 32
    alpha: float = 0.3
    beta: float = 2000
    use_output_projection: bool = True
    use_ema: bool = True
    adaptive_smoothing: bool = True
    kernel_size: int = 5
    indicator: str = "restkv"

    def validate(self) -> None:
        super().validate()
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0.0 < self.alpha <= 1.0:
            raise PolicyConfigError(f"{self.name}: alpha (EMA factor) must be in (0, 1]; got {self.alpha!r}")
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not self.beta > 0:
            raise PolicyConfigError(f"{self.name}: beta (AWS scale) must be a number > 0; got {self.beta!r}")
        if not is_int(self.kernel_size) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise PolicyConfigError(f"{self.name}: kernel_size must be an odd int ≥ 1; got {self.kernel_size!r}")
        for flag in ("use_output_projection", "use_ema", "adaptive_smoothing"):
            if not isinstance(getattr(self, flag), bool):
                raise PolicyConfigError(f"{self.name}: {flag} must be True or False; got {getattr(self, flag)!r}")
        if self.indicator not in INDICATORS:
            raise PolicyConfigError(f"{self.name}: indicator must be one of {INDICATORS}; got {self.indicator!r}")

    def indicators(self, step: LayerStep) -> torch.Tensor:
        """Per-query indicators ``I_t[j]`` ``(batch, q_heads, w, L)`` of the window queries (Eq. 7)."""
        rows = step.window_rows(max(self.window, 1))
        if self.indicator == "vatp":
            return vatp_indicator(rows, step.view.values)
        if self.indicator == "attention":
            return rows
        gram = None
        if self.use_output_projection:
            o_proj = getattr(step.module, step.info.spec.output_proj_attr)
            gram = output_gram(o_proj.weight.detach(), step.info.num_heads)
        return restkv_indicator(rows, step.window_outputs(max(self.window, 1)), step.view.values, gram)

    def raw_scores(self, step: LayerStep) -> torch.Tensor:
        """Smoothed scores ``(batch, kv_heads, L)`` before the window is protected."""
        indicator = self.indicators(step)
        w, groups = indicator.shape[2], step.info.groups
        query_valid = None if step.query_valid is None else step.query_valid[:, -w:]
        prefix = step.view.positions < step.query_positions[-w]
        if step.view.valid is not None:
            prefix = prefix & step.view.valid
        prefix = prefix.repeat_interleave(groups, dim=1)
        if self.use_ema:
            smoothed = ema_over_window(indicator, self.alpha, query_valid)
        else:
            smoothed = mean_over_window(indicator, query_valid)
        smoothed = smoothed.masked_fill(~prefix, 0.0)  # per-entry linear: same as masking every I_t first
        if self.adaptive_smoothing:
            lengths = step.lengths()
            budget = self.target(lengths.cpu(), step.layer_idx, step.info.num_layers).to(lengths.device)
            k = budget.repeat_interleave(groups, dim=1)
            smoothed = adaptive_spatial_smoothing(
                smoothed, indicator, k, prefix, self.beta, query_valid, self.kernel_size
            )
        else:
            smoothed = pool_scores(smoothed, self.kernel_size, "avgpool")
        return reduce_groups(smoothed.float(), step.info.num_kv_heads, "mean")

    def score(self, step: LayerStep) -> torch.Tensor:
        return protect_recent(self.raw_scores(step), step, self.window)
