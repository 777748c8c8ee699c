"""``expected_attention`` scorer (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution", arXiv:2510.00636; public reference: kvpress
``ExpectedAttentionPress``).

Future queries are unknown, but their distribution is not: the pre-RoPE queries of a head are modelled as a
Gaussian ``N(μ, Σ)`` estimated from the prompt's queries (the first ``n_sink`` tokens left out: attention
sinks are outliers), and the rotation the next ``n_future_positions`` positions will apply is averaged,
``R̄ = mean_t R(t)``, so a future query is ``N(R̄μ, R̄ΣR̄ᵀ)`` (Sec. 3.2). For a Gaussian query the expected
un-normalised attention a key receives has a closed form (the moment generating function, Eq. 6)::

    E[exp(s·qᵀk)] = exp(s·μ̄ᵀk + s²/2 · kᵀΣ̄k)        s = the layer's attention scaling (1/√d)

The expected logits are normalised over the head's entries (softmax), averaged over each GQA group, and
scaled by the value norm, ``(ẑ_j + ε)·‖v_j‖`` (Eq. 8: an entry contributes ``a_j v_j`` to the output). The
first ``n_sink`` tokens of each row are always kept and, as in the reference, left out of the softmax (they
would take a different share of each query head's mass and so change the group mean's ranking).

How kvsieve computes it (same quantities, a different route): the reference re-projects the layer's hidden
states through ``q_proj`` to get pre-RoPE queries, which needs per-architecture code (Phi3's fused ``qkv``,
Qwen3's and Gemma3's ``q_norm``). kvsieve un-rotates the post-RoPE queries the attention already received
with the layer's own rotary table (:func:`kvsieve.ops.rope.unrotate`, exact for the static rope types), so
every architecture with rotary embeddings is served by the same code. A row's positions are its real
tokens' indices (padding slots not counted, as ``generate`` numbers a left-padded row), so a padded row
scores as it would alone. ``R̄`` is applied as ``x·mean(cos) + rotate_half(x)·mean(sin)``, which equals the
reference's explicit averaged matrix. The covariance is the biased estimate (divided by the count), as in
the reference. Logit soft-capping (Gemma2) is not modelled. Prefill and blockwise schedules: the statistics
come from the forward's own queries (a decoding step has one query, no distribution).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvsieve.core.part import require_bool, require_int, require_number
from kvsieve.core.preset import Preset
from kvsieve.core.step import LayerStep
from kvsieve.models.architectures import ModelInfo
from kvsieve.ops.rope import RotaryTable, cos_sin, rotary_table, rotate_half, unrotate
from kvsieve.parts.scorers.base import Scorer, check_sinks_and_window, protect_sinks_and_recent

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec


def averaged_rotation(table: RotaryTable, first: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean(cos), mean(sin)`` ``(batch, rotary_dim)`` over positions ``first … first + count − 1`` per row."""
    offsets = torch.arange(count, device=first.device)
    cos, sin = cos_sin(table, first[:, None] + offsets[None, :])
    return cos.mean(dim=1), sin.mean(dim=1)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``R̄ x`` along the last dimension of ``x`` ``(batch, ..., d)`` for one averaged rotation per row."""
    if rotary_dim == 0:
        return x
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rotary_dim,)
    c, s = cos.view(shape), sin.view(shape)
    turned = x[..., :rotary_dim] * c + rotate_half(x[..., :rotary_dim]) * s
    return torch.cat((turned, x[..., rotary_dim:]), dim=-1) if rotary_dim < x.shape[-1] else turned


def query_statistics(
    queries: torch.Tensor, use: torch.Tensor, covariance: bool, overwrite: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean ``(batch, heads, d)`` and biased covariance ``(batch, heads, d, d)`` of ``queries`` ``(batch, heads,
    q, d)`` over the queries where ``use`` ``(batch, q)`` is True (a row with none gets zeros). ``overwrite``: the
    caller's ``queries`` may be centred in place (a buffer it owns) instead of a centred copy being made."""
    weights = use.to(queries.dtype)[:, None, None, :]  # (batch, 1, 1, q)
    count = weights.sum(dim=-1).clamp(min=1.0)  # (batch, 1, 1)
    mean = torch.matmul(weights, queries).squeeze(2) / count  # a weighted sum as one product, no weighted copy
    if not covariance:
        return mean, None
    centred = queries.sub_(mean.unsqueeze(2)) if overwrite else queries - mean.unsqueeze(2)
    centred.mul_(weights.transpose(-1, -2))  # the unused queries out, in place
    cov = torch.matmul(centred.transpose(-1, -2), centred) / count.unsqueeze(-1)
    return mean, cov


@dataclass(frozen=True)
class ExpectedAttention(Scorer):
    """Expected attention of future queries (Gaussian pre-RoPE queries, averaged future rotation) × ‖v‖."""

    name: ClassVar[str] = "expected_attention"
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    window: int = 0

    def validate(self) -> None:
        require_int(self.name, "n_future_positions", self.n_future_positions, 1)
        require_int(self.name, "n_sink", self.n_sink, 0)
        require_bool(self.name, "use_covariance", self.use_covariance)
        require_bool(self.name, "use_vnorm", self.use_vnorm)
        require_number(self.name, "epsilon", self.epsilon, 0.0, math.inf)
        require_int(self.name, "window", self.window, 0)

    def check(self, spec: BudgetSpec) -> None:
        check_sinks_and_window(spec, self.n_sink, self.window)

    def check_model(self, config: Any, info: ModelInfo) -> None:
        """Refuse, before any work, a model whose rotary embedding cannot be un-rotated (pre-RoPE queries)."""
        for layer in info.managed_layers:
            rotary_table(config, layer)

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        view = step.view
        device = view.keys.device
        table = self._table(step, device)
        slots = step.query_positions.unsqueeze(0).expand(step.query.shape[0], -1)
        positions = step.real_positions(slots)  # (batch, q): the model's rotary positions
        raw_queries = unrotate(step.query, positions[:, None, :], table)
        use = positions >= self.n_sink
        if step.query_valid is not None:
            use = use & step.query_valid.to(device)
        owned = raw_queries.untyped_storage().data_ptr() != step.query.untyped_storage().data_ptr()
        mean, cov = query_statistics(raw_queries, use, self.use_covariance, overwrite=owned)  # centred in place
        cos, sin = averaged_rotation(table, positions[:, -1] + 1, self.n_future_positions)
        mean = apply_rotation(mean, cos, sin, table.rotary_dim)
        if cov is not None:  # R̄ Σ R̄ᵀ: rotate the rows, then the columns
            cov = apply_rotation(apply_rotation(cov, cos, sin, table.rotary_dim).transpose(-1, -2), cos, sin,
                                 table.rotary_dim)
        scored = step.entry_valid()
        if self.n_sink:  # the sinks are kept apart: out of the softmax too, as the reference cuts them off first
            scored = scored & (step.real_positions(view.positions) >= self.n_sink)
        return self._scores(view.keys.float(), view.values.float(), scored, mean, cov, step.scaling)

    def __getstate__(self) -> dict[str, object]:
        """Pickled and copied without the per-module table cache (rebuilt on first use)."""
        state = dict(self.__dict__)
        state.pop("_tables", None)
        return state

    def _table(self, step: LayerStep, device: torch.device) -> RotaryTable:
        """The layer's rotary table on ``device``, built once per attention module and device (no host-to-device
        copy per forward); held weakly by the module, so a preset's scorer shared by several models never hands
        one model's table to another."""
        per_module: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, RotaryTable]] = \
            self.__dict__.setdefault("_tables", weakref.WeakKeyDictionary())
        tables = per_module.setdefault(step.module, {})
        key = str(device)
        if key not in tables:
            tables[key] = rotary_table(step.module.config, step.layer_idx, device)
        return tables[key]

    def _scores(
        self, keys: torch.Tensor, values: torch.Tensor, scored: torch.Tensor, mean: torch.Tensor,
        cov: torch.Tensor | None, scaling: float,
    ) -> torch.Tensor:
        """``(batch, kv_heads, L)``: softmax of the expected logits over the ``scored`` entries (real, not sinks),
        mean over each GQA group, × ‖v‖."""
        batch, kv_heads, _, d = keys.shape
        groups = mean.shape[1] // kv_heads
        mean = mean.view(batch, kv_heads, groups, d)
        logits = scaling * torch.matmul(mean, keys.transpose(-1, -2))  # (batch, kv, groups, L)
        if cov is not None:
            # kᵀΣk for every group's Σ at once: the keys times the group's covariances side by side (one product per
            # KV head, the keys not repeated per group), then each product times its key, summed
            length = keys.shape[2]
            side_by_side = cov.view(batch, kv_heads, groups, d, d).permute(0, 1, 3, 2, 4).reshape(
                batch, kv_heads, d, groups * d)
            spread = torch.matmul(keys, side_by_side).view(batch, kv_heads, length, groups, d)
            quadratic = spread.mul_(keys.unsqueeze(3)).sum(dim=-1).transpose(-1, -2)  # (batch, kv, groups, L)
            logits = logits + 0.5 * scaling * scaling * quadratic
        logits = logits.masked_fill(~scored.unsqueeze(2), -math.inf)
        scores = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=2)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)
        return scores

    def protect(self, scores: torch.Tensor, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        """The first ``n_sink`` real tokens of each row always kept (+inf), and the newest ``window``."""
        return protect_sinks_and_recent(scores, step, self.n_sink, self.window)


PRESETS = (
    Preset("expected_attention", "closed-form attention of future queries (Gaussian, averaged RoPE) × ‖v‖",
           scorer=ExpectedAttention()),
)
