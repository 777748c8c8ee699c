"""``restkv`` scorer — ReST-KV (An et al., 2026, "ReST-KV: Robust KV Cache Eviction with Layer-wise
Output Reconstruction and Spatial-Temporal Smoothing", ICLR 2026, arXiv:2605.08840).

Prefill-once, like SnapKV, over the same observation window (the last ``window`` prompt queries).

``order="before"`` (default; the paper's Eq. 7 → 9 order):

1. indicator per window query ``t``, query head ``h`` and held entry ``j`` (Eq. 7, exact single-entry
   removal error of the head's contribution to the layer output, App. A):
   ``I_t[j] = A[t,j] / (1 - A[t,j]) · ‖(o_t - v_j) W_O^h‖₂``, ``o_t`` the full output of query ``t``;
   ablations: ``use_output_projection=False`` gives ``A/(1-A)·‖o_t - v_j‖₂`` ("w/o W_O"),
   ``indicator="vatp"`` gives ``A[t,j]·‖v_j‖₂`` (Table 15, VATP) and ``indicator="attention"`` gives
   ``A[t,j]`` (Table 15 "Attention weights" = Table 3 "w/o LOR");
2. temporal smoothing: EMA over the window queries in order, ``α = 0.3`` (Eq. 9); ``use_ema=False``
   takes the plain mean instead (Table 16 "Mean" = Table 3 "w/o EMA").

``order="after"`` (the authors' scripts, ``metric_mode="after"``): EMA (or mean) of the window
attention over the prefix entries first, ``a_j``; then ``o = Σ_{j ∈ prefix} a_j v_j`` (the window's own
entries left out, no renormalisation) and ``s_j = a_j / (1 - a_j) · ‖(o - v_j) W_O^h‖₂``.

3. spatial smoothing: adaptive window (AWS, Eq. 10–13, ``β = 2000``) with ``B`` the head's budget around
   a base kernel ``kernel_size`` (App. B: k = 5 for ReST-KV, 21 on RULER). ``width_rule="max"`` (default,
   the authors' code): ``W_s = max(k, 2⌊|ΔD|/β⌋ + 1)``; ``width_rule="sum"`` (kvsieve ≤ 0.1):
   ``W_s = k + 2⌊|ΔD|/β⌋``; both equal ``k`` whenever ``|ΔD| < β``. Eq. 11 printed literally
   (``kernel_size=1``) is 1 — no smoothing — unless the important entries drift by ≥ β tokens, which
   made ReST-KV worse than SnapKV on the default model (``docs/results/issue3``). Eq. 12's shift is
   rounded towards zero (the authors' code applies the printed ``⌊x⌋ + 1`` for ``x ≤ 0``, i.e. γ = 1 when
   nothing drifted; see :func:`kvsieve.ops.smoothing.adaptive_window`); the edges are zero padded
   (the authors' code repeats the edge value). ΔD comes from each query's indicator (``before``) or its
   attention row (``after``, as the authors' code does in both modes).
   ``adaptive_smoothing=False`` uses SnapKV's avgpool with ``kernel_size`` (Table 16 "Avgpool";
   ``kernel_size=1`` there is Table 3's "w/o AWS").
4. GQA: mean over the query heads of each KV group (:func:`kvsieve.ops.gqa.reduce_groups`); the authors' code instead
   expands the keys/values to every query head and selects per query head — ``KVCache(..., expand_gqa=True)``
   gives that (``g×`` the memory). The window is always kept (Eq. 8's Ω).

Only entries before the window (Eq. 8's ``n < t - S_w``) compete: window entries get 0 before smoothing
(as in SnapKV's reference code). Extra cost over SnapKV: ``o_t`` from the window rows already computed,
the per-head ``d×d`` Gram of ``W_O^h`` and one ``(w×d)·(d×L)`` product per head —
``O(w·L·d + L·d²)`` like SnapKV's ``O(w·L·d)``; the Gram matrices are computed once per layer and weight
(:func:`cached_output_gram`). On the CPU a prompt without padding takes steps 1–3 — the indicator, temporal smoothing,
each window query's top-``B`` mean index and the adaptive window — from one C pass over the values
(:mod:`kvsieve.native.restkv_scores`, within float32 rounding of the PyTorch path, which stays the reference); with
bf16 values on an AMX CPU the pass also computes the window's outputs ``o_t``, and its products run on the tiles.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.core.part import (
    PolicyConfigError,
    require_bool,
    require_choice,
    require_int,
    require_number,
    require_odd_int,
)
from kvsieve.core.preset import Preset
from kvsieve.core.step import OUTPUT_PROJECTION, WINDOW_OUTPUTS, WINDOW_ROWS, LayerStep
from kvsieve.native.restkv_scores import computes_outputs, window_scores
from kvsieve.ops.gqa import reduce_groups
from kvsieve.ops.pooling import pool_scores
from kvsieve.ops.reconstruction import EPS, output_gram, restkv_indicator, vatp_indicator
from kvsieve.ops.smoothing import (
    adaptive_spatial_smoothing,
    ema_over_window,
    ema_weights,
    mean_over_window,
)
from kvsieve.parts.allocators.adaptive import Adaptive
from kvsieve.parts.allocators.pyramid import Pyramid
from kvsieve.parts.scorers.base import Scorer

INDICATORS = ("restkv", "vatp", "attention")

@functools.lru_cache(maxsize=64)
def window_weights(w: int, alpha: float | None) -> torch.Tensor:
    """The ``w`` window queries' weights in Eq. 9's EMA with factor ``alpha`` (:func:`ema_weights`, every query real)
    or, with ``alpha=None``, the plain mean's, as float32 on the CPU: the same for every layer, so computed once (the
    native pass reads them; nothing writes to them)."""
    if alpha is None:
        return torch.full((w,), 1.0 / w, dtype=torch.float64).float()
    return ema_weights(torch.ones(1, w, dtype=torch.bool), alpha)[0].float()


#: Each attention module's ``W_O`` Gram matrices, with the weight they were computed from: ``module → (weight,
#: version, q_heads, gram)``. Dropped with the module (weak keys).
_GRAMS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.Tensor, int, int, torch.Tensor]] = (
    weakref.WeakKeyDictionary())


def cached_output_gram(module: torch.nn.Module, weight: torch.Tensor, q_heads: int) -> torch.Tensor:
    """:func:`~kvsieve.ops.reconstruction.output_gram` of ``weight`` (the module's ``W_O``, detached), computed once
    per module and weight: again when the weight is another tensor (a new data pointer: the entry holds the former
    weight's storage, so its address cannot be reused meanwhile), another shape or dtype, or was changed in place (its
    version counter, which a detached weight shares with the parameter). Weights without a version counter (made
    under ``torch.inference_mode``) and modules that take no weak reference are not cached. The Grams are
    ``q_heads·d²`` float32 per layer (2 MiB for a 32-head, ``d = 128`` layer), held while the model lives."""
    try:
        version = weight._version
        held = _GRAMS.get(module)
    except (RuntimeError, TypeError):  # an inference tensor; a module that takes no weak reference
        return output_gram(weight, q_heads)
    if (held is not None and held[0].data_ptr() == weight.data_ptr() and held[0].shape == weight.shape
            and held[0].dtype == weight.dtype and held[0].device == weight.device and held[1] == version
            and held[2] == q_heads):
        return held[3]
    gram = output_gram(weight, q_heads)
    _GRAMS[module] = (weight, version, q_heads, gram)
    return gram


@dataclass(frozen=True)
class OutputReconstruction(Scorer):
    """Layer-wise output reconstruction indicator with EMA and adaptive-window smoothing; keeps the window."""

    name: ClassVar[str] = "restkv"
    NEEDS: ClassVar[frozenset[str]] = frozenset({WINDOW_ROWS, WINDOW_OUTPUTS, OUTPUT_PROJECTION})
    window: int = 32
    alpha: float = 0.3
    beta: float = 2000
    use_output_projection: bool = True
    use_ema: bool = True
    adaptive_smoothing: bool = True
    kernel_size: int = 5
    indicator: str = "restkv"
    width_rule: str = "max"
    order: str = "before"

    def validate(self) -> None:
        require_int(self.name, "window", self.window, 0)
        require_number(self.name, "alpha (EMA factor)", self.alpha, 0.0, 1.0, low_open=True)
        require_number(self.name, "beta (AWS scale)", self.beta, 0.0, float("inf"), low_open=True)
        require_odd_int(self.name, "kernel_size", self.kernel_size)
        for flag in ("use_output_projection", "use_ema", "adaptive_smoothing"):
            require_bool(self.name, flag, getattr(self, flag))
        require_choice(self.name, "indicator", self.indicator, INDICATORS)
        require_choice(self.name, "width_rule", self.width_rule, ("max", "sum"))
        require_choice(self.name, "order", self.order, ("before", "after"))
        if self.order == "after" and self.indicator != "restkv":
            raise PolicyConfigError(f"{self.name}: order='after' is defined for indicator='restkv' only")

    def _gram(self, step: LayerStep) -> torch.Tensor | None:
        if not self.use_output_projection:
            return None
        return cached_output_gram(step.module, step.output_projection(), step.query.shape[1])

    def indicators(self, step: LayerStep) -> torch.Tensor:
        """Per-query indicators ``I_t[j]`` ``(batch, q_heads, w, L)`` of the window queries (Eq. 7)."""
        rows = step.window_rows(max(self.window, 1))
        if self.indicator == "vatp":
            return vatp_indicator(rows, step.view.values)
        if self.indicator == "attention":
            return rows
        return restkv_indicator(rows, step.window_outputs(max(self.window, 1)), step.view.values, self._gram(step))

    def _temporal(self, indicator: torch.Tensor, query_valid: torch.Tensor | None) -> torch.Tensor:
        if self.use_ema:
            return ema_over_window(indicator, self.alpha, query_valid)
        return mean_over_window(indicator, query_valid)

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        """Smoothed scores ``(batch, kv_heads, L)`` before the window is protected."""
        rows = step.window_rows(max(self.window, 1))
        w, groups = rows.shape[2], step.groups
        query_valid = None if step.query_valid is None else step.query_valid[:, -w:]
        prefix = step.view.positions < step.query_positions[-w]
        if step.view.valid is not None:
            prefix = prefix & step.view.valid
        native = self._native_raw(step, rows, prefix, nominal)
        if native is not None:
            return native
        prefix = prefix.repeat_interleave(groups, dim=1)
        if self.order == "before":
            drift_source = self.indicators(step)
            smoothed = self._temporal(drift_source, query_valid)
        else:
            drift_source = rows
            attention = self._temporal(rows.masked_fill(~prefix.unsqueeze(2), 0.0), query_valid)
            smoothed = self._after_scores(attention, step)
        smoothed = smoothed.masked_fill(~prefix, 0.0)  # per-entry linear: same as masking every I_t first
        if self.adaptive_smoothing:
            k = nominal.repeat_interleave(groups, dim=1)
            smoothed = adaptive_spatial_smoothing(
                smoothed, drift_source, k, prefix, self.beta, query_valid, self.kernel_size, self.width_rule
            )
        else:
            smoothed = pool_scores(smoothed, self.kernel_size, "avgpool")
        return reduce_groups(smoothed.float(), step.kv_heads, "mean")

    def _native_raw(self, step: LayerStep, rows: torch.Tensor, prefix: torch.Tensor, nominal: torch.Tensor
                    ) -> torch.Tensor | None:
        """:meth:`raw` with the indicator, its temporal smoothing and each window query's top-``k`` mean index from one
        C pass over the values (:mod:`kvsieve.native.restkv_scores`, within float32 rounding); None where it does not
        apply: not on the CPU, ``order="after"`` or another indicator, padding, or a prefix that is not the same
        leading run of entries in every head (a first prompt's)."""
        if (step.query.device.type != "cpu" or self.order != "before" or self.indicator != "restkv"
                or step.query_valid is not None or step.view.valid is not None):
            return None
        count = int(prefix[0, 0].sum())  # one host read; checked below to be every head's leading run
        leading = torch.arange(prefix.shape[-1], device=prefix.device) < count
        if not bool((prefix == leading).all()):
            return None
        w, groups = rows.shape[2], step.groups
        weights = window_weights(w, self.alpha if self.use_ema else None)
        budgets = nominal.repeat_interleave(groups, dim=1).long().contiguous() if self.adaptive_smoothing else None
        drift = (self.beta, self.kernel_size, self.width_rule) if self.adaptive_smoothing else None
        values = step.view.values
        # the window's outputs from the pass itself where it can (bf16 values: on the AMX tiles), else PyTorch's
        outputs = None if computes_outputs(values) else step.window_outputs(max(self.window, 1)).contiguous()
        result = window_scores(rows.contiguous(), outputs, values, self._gram(step), weights, budgets, count, EPS,
                               drift)
        if result is None:
            return None
        smoothed = result[0]  # the adaptive window applied by the pass (drift_window_mean's, bit for bit)
        if not self.adaptive_smoothing:
            smoothed = pool_scores(smoothed, self.kernel_size, "avgpool")
        return reduce_groups(smoothed.float(), step.kv_heads, "mean")

    def _after_scores(self, attention: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """``a/(1-a)·‖(o - v_j) W_O^h‖``, ``o = Σ_prefix a_j v_j`` (``metric_mode="after"``), ``(b, q_heads, L)``."""
        values = step.view.values.float()
        if step.view.valid is not None:
            values = values.masked_fill(~step.view.valid.unsqueeze(-1), 0.0)
        batch, q_heads, length = attention.shape
        grouped = attention.reshape(batch, step.kv_heads, q_heads // step.kv_heads, length)
        outputs = torch.matmul(grouped, values).reshape(batch, q_heads, 1, -1)
        return restkv_indicator(attention.unsqueeze(2), outputs, values, self._gram(step))[:, :, 0]


PRESETS = (
    Preset("restkv", "output-reconstruction error with EMA and adaptive-window smoothing",
           scorer=OutputReconstruction()),
    Preset("pyramid_restkv", "restkv scores with PyramidKV layer budgets", scorer=OutputReconstruction(),
           allocator=Pyramid()),
    Preset("ada_restkv", "restkv scores with AdaKV head budgets", scorer=OutputReconstruction(), allocator=Adaptive()),
)
