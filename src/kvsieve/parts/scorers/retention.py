"""``retention`` scorer — learned retention gates: TrimKV (Bui et al. 2025, "Cache What Lasts: Token Retention
for Memory-Bounded KV Cache in LLMs", arXiv:2512.03324) and DBTrimKV (Bui et al., 2026, "Make Each Token
Count", arXiv:2605.09649, Sec. 4.2).

When a token enters the cache its layer's gate reads the layer's attention input (after the norm, from
:mod:`kvsieve.engine.layer_inputs`) and predicts ``log β_i`` per KV head; it is kept per entry as side data
``log_beta`` and never recomputed (Sec. 3.2: "we estimate it only once when the token enters the cache").
At an eviction at time ``t`` (the newest query's slot) an entry's score is its predicted utility over a
lookahead of ``n`` steps (Sec. 4.2, horizon weights 1)::

    log G_i(t) = log Σ_{k=1..n} β_i^{t−i+k} = (t + 1 − i)·log β_i + log(1 − β_i^n) − log(1 − β_i)

(``n = 1``: TrimKV's myopic ``(t + 1 − i)·log β_i``), computed from ``log β`` with ``expm1`` so β ≈ 1
(``b_out = 18``) stays finite. The ``window`` newest entries of each head are always kept.

Readings: the paper's default lookahead was lost in extraction (its ablation, App. C.3, compares three
values and calls the default "moderate"); kvsieve uses ``lookahead = 32``. Retention only decides
eviction: attention over the kept entries is the model's own (no ``β^{t−i}`` bias at inference, as in
the authors' inference code); the bias exists only in training (:mod:`kvsieve.train.gated_attention`).
The gates are loaded for the model when the cache is built (:meth:`RetentionGate.bind`): ``gates`` is a
path stem, a :class:`~kvsieve.gates.RetentionGates` object, or None for the shipped gate named by
``pretrained``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvsieve.cache.store import SideSpec
from kvsieve.core.part import PolicyConfigError, require_choice, require_int
from kvsieve.core.preset import Preset
from kvsieve.core.step import LAYER_INPUTS, AppendedUpdate, DeferredUpdate, LayerStep
from kvsieve.parts.allocators.global_budget import GlobalBudget
from kvsieve.parts.schedules import Decode
from kvsieve.parts.scorers.base import ALL_SCHEDULES, Scorer

if TYPE_CHECKING:
    from kvsieve.gates.retention import RetentionGates

LOG_BETA = "log_beta"
_VARIANTS = ("trimkv", "dbtrimkv", "dbtrimkv_untied")


def log_horizon(log_beta: torch.Tensor, lookahead: int) -> torch.Tensor:
    """``log Σ_{k=0}^{n−1} β^k = log(1 − β^n) − log(1 − β)`` from ``log β ≤ 0``, stable for β → 1 (→ ``log n``)."""
    if lookahead == 1:
        return torch.zeros_like(log_beta)
    lb = log_beta.clamp(max=-1e-30)
    return torch.log(-torch.expm1(lookahead * lb)) - torch.log(-torch.expm1(lb))


def retention_score(log_beta: torch.Tensor, age: torch.Tensor, lookahead: int) -> torch.Tensor:
    """``log G_i(t) = (t + 1 − i)·log β_i + log_horizon`` with ``age = t − i`` (float32)."""
    lb = log_beta.float()
    return (age.float() + 1.0) * lb + log_horizon(lb, lookahead)


@dataclass(frozen=True)
class LayerGate:
    """One layer's ``log β`` from its attention inputs: ``(batch, tokens, d)`` → ``(batch, kv_heads, tokens)``
    (float32; repeated per query head when the store keeps one head per query head, ``expand_gqa``). What
    :meth:`RetentionGate.observe` computes at once for a prompt and hands to the store for a decoding step."""

    gates: RetentionGates
    layer: int
    kv_heads: int

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            new = self.gates.log_beta(self.layer, inputs)
        if new.shape[1] != self.kv_heads:  # expand_gqa: one store head per query head
            new = new.repeat_interleave(self.kv_heads // new.shape[1], dim=1)
        return new


@dataclass(frozen=True)
class RetentionGate(Scorer):
    """Learned retention ``log G_i(t)`` with a lookahead of ``lookahead`` steps and a protected recent window."""

    name: ClassVar[str] = "retention"
    SCHEDULES: ClassVar[tuple[str, ...]] = ALL_SCHEDULES
    NEEDS: ClassVar[frozenset[str]] = frozenset({LAYER_INPUTS})
    SIDE: ClassVar[tuple[SideSpec, ...]] = (SideSpec(LOG_BETA),)
    gates: Any = None
    pretrained: str = "dbtrimkv"
    lookahead: int = 32
    window: int = 8

    def validate(self) -> None:
        from pathlib import Path

        from kvsieve.gates.retention import RetentionGates

        require_int(self.name, "lookahead", self.lookahead, 1)
        require_int(self.name, "window", self.window, 0)
        require_choice(self.name, "pretrained", self.pretrained, _VARIANTS)
        if self.gates is not None and not isinstance(self.gates, str | Path | RetentionGates):
            raise PolicyConfigError(
                f"{self.name}: gates must be None (shipped gates), a path stem or a RetentionGates; got {self.gates!r}"
            )

    def bind(self, model: torch.nn.Module) -> RetentionGate:
        """A copy holding the gates loaded for ``model`` (refuses gates trained for another architecture), on the
        model's device."""
        from kvsieve.gates.pretrained import load_pretrained
        from kvsieve.gates.retention import RetentionGates, load_gates

        if isinstance(self.gates, RetentionGates):
            self.gates.config.check_model(model)
            loaded = self.gates.on(next(iter(model.parameters())).device)  # gates built on the CPU, model on a GPU
        elif self.gates is not None:
            loaded = load_gates(self.gates, model)
        else:
            loaded = load_pretrained(model, self.pretrained)
        bound = replace(self)
        object.__setattr__(bound, "_loaded", loaded)
        return bound

    def _gates(self) -> RetentionGates:
        loaded = getattr(self, "_loaded", None)
        if loaded is None:
            raise RuntimeError(f"{self.name}: gates are not loaded; build the cache with KVCache(model, ...)")
        return loaded

    def observe(self, step: LayerStep) -> dict[str, torch.Tensor | AppendedUpdate | DeferredUpdate]:
        """``log β`` of this forward's new entries, written where the store put them (the held entries' are
        unchanged: a decoding step touches one row per head). A decoding step's is deferred: the store keeps the
        token's layer input and computes the ``log β`` of every step since in one batch when the layer is next planned
        (or anything else reads its side data): the gates cost a few operations per layer and plan instead of per
        layer and step (:mod:`kvsieve.cache.deferred_side`)."""
        if step.is_decoding and step.q_len == 1 and step.query_valid is None:
            return self.decoding_updates(step.layer_idx, step.kv_heads, step.inputs())
        return {LOG_BETA: AppendedUpdate(LayerGate(self._gates(), step.layer_idx, step.kv_heads)(step.inputs()))}

    def decoding_updates(self, layer_idx: int, kv_heads: int, inputs: torch.Tensor) -> dict[str, DeferredUpdate]:
        """A decoding step's ``log β``, deferred: its layer input and the layer's gate."""
        return {LOG_BETA: DeferredUpdate(inputs, LayerGate(self._gates(), layer_idx, kv_heads))}

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        view = step.view
        return retention_score(view.extras[LOG_BETA], step.ages(view.positions), self.lookahead)


__all__ = ["LOG_BETA", "RetentionGate", "log_horizon", "retention_score"]


PRESETS = (
    Preset("trimkv", "learned retention gates (untied), top-M per head, evicting at prefill and decoding",
           scorer=RetentionGate(pretrained="trimkv"), schedule=Decode(buffer=16)),
    Preset("dbtrimkv", "learned retention gates (tied readout), one global budget over all layers and heads",
           scorer=RetentionGate(pretrained="dbtrimkv"), allocator=GlobalBudget(), schedule=Decode(buffer=16)),
    Preset("dbtrimkv_untied", "dbtrimkv's global ranking with untied gates (the paper's no-tying ablation)",
           scorer=RetentionGate(pretrained="dbtrimkv_untied"), allocator=GlobalBudget(), schedule=Decode(buffer=16)),
)
