"""CAKE (Qin et al. 2025, "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences", ICLR 2025,
arXiv:2503.12491; public code: the ``cakekv`` repository, ``cake/model/modify_llama.py`` and ``cake/utils.py``).
One method, two parts:

* ``cake`` **allocator** — layer budgets from each layer's *preference* (Sec. 4.1). From the attention
  ``A`` of the last ``w`` prompt queries over the entries before the window, a layer's spatial dispersion
  is the entropy ``H = −Σ A log A`` (Eq. 3) and its temporal shift the variance over the window queries,
  summed over entries, ``V = Σ_j Var_t A[t, j]`` (Eq. 4); the preference is ``P = H^{1/τ₁} · V^{1/τ₂}``
  (Eq. 5, sums over the heads of the layer) and layer ``l`` gets ``B_l = P_l / Σ P · L·(B − w)`` entries
  besides its window (Eq. 6), the same for every KV head of the layer. As the reference's
  ``adjust_budgets``: budgets are truncated to integers, capped at what a layer holds before its window,
  the excess spread evenly over the uncapped layers, then the total restored to ``L·(B − w)`` evenly.
* ``cake`` **scorer** — the eviction indicator (Sec. 4.2, Eq. 8): mean plus ``γ`` times the variance of
  each entry's window attention, ``I_j = mean_t A[t, j] + γ·Var_t A[t, j]`` (unbiased variance, as
  ``torch.var``), pooled (kernel 5) and averaged over each GQA group; the window itself is kept.

How kvsieve differs from the reference: the reference sums the preference over the whole batch (its runs
use batch 1); kvsieve computes it per batch row, so each row is its own request. The reference's
*cascading* mode only bounds the peak memory while the prompt is read (layers are compacted as they come, to
the budgets the preferences seen so far give); its final budgets are the same as the non-cascading ones,
which kvsieve computes once after the last layer (global allocators plan once per forward). The reference
leaves a prompt whole up to ``B + w`` tokens; kvsieve compresses as soon as a head holds more than its
budget ``B``, as every other kvsieve policy does. Defaults are
the reference's command-line defaults (``τ₁ = τ₂ = 1``, ``γ = 200``, ``w = 32``); the reference tunes
``τ₁, τ₂`` per model and budget. The allocator composes with any scorer (``KVCache(model, "restkv",
allocator="cake")``); its preference always reads the last ``preference_window`` queries' attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.core.part import PolicyConfigError, require_int, require_number, require_odd_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import WINDOW_ROWS, LayerStep
from kvsieve.ops.gqa import reduce_groups
from kvsieve.ops.pooling import pool_scores
from kvsieve.parts.allocators.base import Allocator
from kvsieve.parts.scorers.base import Scorer

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec

#: The reference's ``log(A + 1e-10)``.
ENTROPY_EPS = 1e-10


def window_prefix_rows(step: LayerStep, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The last ``w`` queries' attention ``(batch, q_heads, w, L)`` with the window's own entries zeroed,
    the mask of entries before the window ``(batch, kv_heads, L)`` and the real window queries ``(batch, w)`` (None:
    every one is real)."""
    rows = step.window_rows(max(window, 1))
    w = rows.shape[2]
    first_window_position = step.query_positions[-w]
    prefix = (step.view.positions < first_window_position) & step.entry_valid()
    in_prefix = prefix.repeat_interleave(step.groups, dim=1).unsqueeze(2)
    queries = None if step.query_valid is None else step.query_valid[:, -w:].to(rows.device)
    return rows * in_prefix, prefix, queries


def window_statistics(step: LayerStep, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window's prefix rows (:func:`window_prefix_rows`) and their mean and variance
    (:func:`window_mean_var`), computed once per step: the indicator and the layer preference both read them."""
    key = ("cake_window_statistics", window)
    if key not in step._memo:
        rows, _, queries = window_prefix_rows(step, window)
        step._memo[key] = (rows, *window_mean_var(rows, queries))
    cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = step._memo[key]
    return cached


def window_mean_var(rows: torch.Tensor, queries: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance over the real window queries ``queries`` ``(batch, w)`` (None: all of them),
    ``(batch, q_heads, L)`` each.

    Without padding the 0/1 query weights would all be ones: they are not multiplied in (the same sums, bit for
    bit: ×1.0 is exact), and the squared deviations are made in place: two passes over the window's ``w × L``
    rows per head instead of five."""
    if queries is None:
        count = torch.full((), float(rows.shape[2]), dtype=rows.dtype, device=rows.device)
        mean = rows.sum(dim=2) / count.clamp(min=1.0)
        squares = torch.sub(rows, mean.unsqueeze(2)).square_().sum(dim=2)
        return mean, squares / (count - 1.0).clamp(min=1.0)
    weights = queries.to(rows.dtype)[:, None, :, None]
    count = weights.sum(dim=2)
    mean = (rows * weights).sum(dim=2) / count.clamp(min=1.0)
    squares = torch.sub(rows, mean.unsqueeze(2)).square_().mul_(weights).sum(dim=2)
    return mean, squares / (count - 1.0).clamp(min=1.0)


@dataclass(frozen=True)
class CakeIndicator(Scorer):
    """Mean + γ·variance of the window's attention (temporal-shift-aware), pooled; the window kept."""

    name: ClassVar[str] = "cake"
    NEEDS: ClassVar[frozenset[str]] = frozenset({WINDOW_ROWS})
    window: int = 32
    gamma: float = 200.0
    kernel_size: int = 5

    def validate(self) -> None:
        require_int(self.name, "window", self.window, 0)
        require_number(self.name, "gamma", self.gamma, 0.0, math.inf)
        require_odd_int(self.name, "kernel_size", self.kernel_size)

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        _, mean, var = window_statistics(step, self.window)
        pooled = pool_scores(mean + self.gamma * var, self.kernel_size, "avgpool")
        return reduce_groups(pooled, step.kv_heads, "mean")


def layer_preference(step: LayerStep, window: int, tau1: float, tau2: float) -> torch.Tensor:
    """``P = H^{1/τ₁} · V^{1/τ₂}`` of one layer per batch row ``(batch,)`` (Eq. 3–5, float32)."""
    rows, _, var = window_statistics(step, window)
    entropy = -torch.add(rows, ENTROPY_EPS).log_().mul_(rows).sum(dim=(1, 2, 3))  # in place: one buffer
    shift = var.sum(dim=(1, 2))
    return entropy.clamp(min=0.0) ** (1.0 / tau1) * shift.clamp(min=0.0) ** (1.0 / tau2)


def cascade_budgets(preference: torch.Tensor, total: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Per-layer budgets ``(batch, layers)`` from preferences ``(batch, layers)``: the reference's
    ``adjust_budgets`` per row — truncate ``P/ΣP·total``, cap at ``caps``, spread the excess evenly over the
    uncapped layers (the first ones get the remainder), then restore the total evenly."""
    layers = preference.shape[1]
    weight = preference / preference.sum(dim=1, keepdim=True).clamp(min=torch.finfo(preference.dtype).tiny)
    equal = torch.full_like(weight, 1.0 / layers)
    weight = torch.where(preference.sum(dim=1, keepdim=True) > 0, weight, equal)  # no signal: uniform
    budgets = torch.floor(weight * total[:, None].to(weight.dtype)).long()
    excess = (budgets - caps).clamp(min=0).sum(dim=1)
    budgets = torch.minimum(budgets, caps)
    budgets = budgets + _spread(excess, budgets < caps)
    diff = total - budgets.sum(dim=1)
    budgets = budgets + _spread(diff.clamp(min=0), budgets < caps)
    return budgets - _spread((-diff).clamp(min=0), budgets > 1)


def _spread(amount: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """``amount`` ``(batch,)`` split evenly over the ``eligible`` layers, the first ones one more for the remainder."""
    count = eligible.sum(dim=1)
    per = torch.where(count > 0, amount // count.clamp(min=1), 0)
    rest = torch.where(count > 0, amount % count.clamp(min=1), 0)
    rank = eligible.long().cumsum(dim=1) - 1
    return eligible.long() * (per[:, None] + (rank < rest[:, None]).long())


@dataclass(frozen=True)
class CakeAllocator(Allocator):
    """Layer budgets proportional to each layer's attention dispersion × temporal shift (one total)."""

    name: ClassVar[str] = "cake"
    scope: ClassVar[str] = "global"
    accepts_ratio: ClassVar[bool] = False
    SCHEDULES: ClassVar[tuple[str, ...]] = ("prefill",)
    NEEDS: ClassVar[frozenset[str]] = frozenset({WINDOW_ROWS})
    tau1: float = 1.0
    tau2: float = 1.0
    preference_window: int = 32

    def validate(self) -> None:
        require_number(self.name, "tau1", self.tau1, 0.0, math.inf, low_open=True)
        require_number(self.name, "tau2", self.tau2, 0.0, math.inf, low_open=True)
        require_int(self.name, "preference_window", self.preference_window, 1)

    def check(self, spec: BudgetSpec) -> None:
        if spec.budget is None:
            raise PolicyConfigError(f"{spec.name}: the cake allocator needs an absolute budget (int ≥ 1), not a ratio")

    def layer_statistic(self, step: LayerStep) -> torch.Tensor | None:
        return layer_preference(step, self.preference_window, self.tau1, self.tau2)

    def allocate_global(
        self, scores: list[torch.Tensor], nominal: list[torch.Tensor], lengths: list[torch.Tensor],
        statistics: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        if statistics is None:
            raise ValueError("cake: allocate_global needs every layer's preference (statistics)")
        device = scores[0].device
        protected = [torch.isposinf(s).sum(dim=-1) for s in scores]
        held = [n.to(device) for n in lengths]
        # besides its window, a layer may use at most what its fullest head holds before the window
        caps = torch.stack([(n - p).clamp(min=0).amax(dim=1) for n, p in zip(held, protected, strict=True)], dim=1)
        spare = torch.stack([(b.to(device) - p).clamp(min=0).amax(dim=1) for b, p in
                             zip(nominal, protected, strict=True)], dim=1)
        preference = torch.stack([s.to(device).float() for s in statistics], dim=1)
        budgets = cascade_budgets(preference, spare.sum(dim=1), caps)
        return [torch.minimum(p + budgets[:, i, None], n) for i, (p, n) in enumerate(zip(protected, held,
                                                                                            strict=True))]


PRESETS = (
    Preset("cake", "CAKE: layer budgets from attention entropy × variance, mean + γ·variance indicator",
           scorer=CakeIndicator(), allocator=CakeAllocator()),
)
