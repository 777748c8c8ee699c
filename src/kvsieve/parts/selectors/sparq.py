"""``sparq`` selector (Ribar et al. 2024, "SparQ Attention: Bandwidth-Efficient LLM Inference",
arXiv:2312.04985, Alg. 1), budgeted as RocketKV (Behnam et al., 2025, arXiv:2502.14051) does (Sec. 3.6 and App. A.3).

Per decoding step (Alg. 1):

1. ``i1`` = the ``r`` largest ``|q_i|``; approximate scores ``ŝ = softmax(q[i1]·K[:, i1]ᵀ / τ)`` with
   ``τ = √(d · ‖q[i1]‖₁ / ‖q‖₁)`` (here ``1/τ = scaling / √(‖q[i1]‖₁ / ‖q‖₁)``, the model's own scaling);
2. ``i2`` = the top-``k`` tokens of ``ŝ``, ``α = Σ_{j∈i2} ŝ_j``;
3. ``y = α · softmax(q·K[i2]ᵀ)·V[i2] + (1 − α) · v̄``, ``v̄`` the mean of every held value.

Reading of step 3: ``α`` is the *approximate* attention mass of the selected tokens and ``v̄`` stands for
every unselected value (the paper's "mean value reallocation"); ``v̄`` is kept as a running per-head sum
(:class:`~kvsieve.cache.value_mean.ValueSum`) so it costs one ``d``-vector read. GQA (SparQ is written
for multi-head attention; RocketKV runs it per group): ``i1`` from the group-summed ``|q|``, ``ŝ`` per
head on those dimensions, ``i2`` from ``ŝ`` summed over the group (one selection per KV group), ``α``
per head.

**Selection, not eviction**: nothing is deleted. Storage: the cache plus one ``d``-vector per head; the
paper's ``2×`` (Table 1) is a second, transposed copy of the keys for fast column reads on a GPU, which
kvsieve does not keep (a column gather reads the same elements).

Budget reading (``k`` = token budget ``t`` per KV group): ``t/2`` tokens are attended (``top``), and the
approximation reads ``r`` of ``d`` key columns of ``N`` entries — ``N·r/(2d)`` tokens — so
``r = ⌊d·t/N⌋ = ⌊d/c⌋`` (at least 1), derived from what the layer holds at the first decoding step after
each prompt (``r=0``) or given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.cache.selection_state import SelectionState, hook_of, selected_nbytes, state_of
from kvsieve.cache.store import LayerStore, StoreHook
from kvsieve.cache.value_mean import ValueSum
from kvsieve.core.part import require_int
from kvsieve.core.preset import Preset
from kvsieve.core.selection import Selection
from kvsieve.core.step import LayerStep
from kvsieve.parts.selectors.base import Selector
from kvsieve.parts.selectors.sparse import grouped_query, per_query_head, split_budget


@dataclass(frozen=True)
class SparQ(Selector):
    """Top-``r`` query dimensions approximate the scores; exact attention on the top tokens, mixed with ``v̄``."""

    name: ClassVar[str] = "sparq"
    #: Token budget ``t`` per KV group and decoding step (approximation + exact attention).
    k: int = 256
    #: Query dimensions of the approximation; 0: ``⌊d·t/N⌋`` (at least 1) at the first decoding step of a prompt.
    r: int = 0
    #: Tokens given exact attention; 0: ``t/2``.
    top: int = 0

    def validate(self) -> None:
        require_int(self.name, "k", self.k, 2)
        require_int(self.name, "r", self.r, 0)
        require_int(self.name, "top", self.top, 0)

    def hooks(self) -> list[StoreHook]:
        return [SelectionState(), ValueSum()]

    def configure(self, held: int, dim: int) -> int:
        """Approximation dimensions for ``held`` entries of ``dim`` dimensions."""
        return min(self.r or max(dim * self.k // max(held, 1), 1), dim)

    def row_config(self, store: LayerStore) -> list[dict[str, int]] | None:
        return [{"r": self.configure(int(n), store.head_dim)} for n in store.lengths().amax(dim=1).tolist()]

    def preset(self, store: LayerStore, config: dict[str, int]) -> None:
        state = state_of(store)
        state.config, state.dirty = dict(config), False

    def select(self, step: LayerStep) -> Selection | None:
        store, view = step.store, step.view
        length, dim = view.length, store.head_dim
        state = state_of(store)
        if self.k >= length:
            state.record(store, store.kv_nbytes())
            return None
        if state.dirty:
            state.config = {"r": self.configure(store.held_max_length, dim)}
            state.dirty = False
        r = state.config["r"]
        top = min(self.top or split_budget(self.k), length)
        query = grouped_query(step.query, store.heads)  # (b, kv, g, d)
        batch, kv_heads, groups, _ = query.shape
        dims = torch.topk(query.abs().sum(dim=2), r, dim=-1).indices  # (b, kv, r)
        q_r = query.gather(-1, dims[:, :, None, :].expand(-1, -1, groups, -1))  # (b, kv, g, r)
        k_r = view.keys.gather(-1, dims[:, :, None, :].expand(-1, -1, length, -1)).float()  # (b, kv, L, r)
        share = q_r.abs().sum(dim=-1) / query.abs().sum(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
        logits = torch.matmul(q_r, k_r.transpose(-1, -2)) * (step.scaling / share.clamp(min=1e-30).sqrt())[..., None]
        bias = step.bias()
        if bias is not None:
            logits = logits + bias[:, :, None, :]
        if view.valid is not None:
            logits = logits.masked_fill(~view.valid[:, :, None, :], float("-inf"))
        approx = torch.softmax(logits, dim=-1)  # (b, kv, g, L)
        chosen = torch.topk(approx.sum(dim=2), top, dim=-1).indices  # (b, kv, top)
        mass = approx.gather(-1, chosen[:, :, None, :].expand(-1, -1, groups, -1)).sum(dim=-1)  # (b, kv, g)
        values = hook_of(store, ValueSum)
        assert isinstance(values, ValueSum)
        mean = values.mean(store, step.lengths())  # (b, kv, d)
        # the approximation reads r columns of the dense view's keys (quantized ones counted as dequantized)
        read = batch * kv_heads * (length * r * store.keys.element_size() + dim * 4) + selected_nbytes(store, chosen)
        state.record(store, read)
        return Selection(
            indices=per_query_head(chosen, groups),
            weight=mass.reshape(batch, kv_heads * groups),
            fallback=per_query_head(mean, groups),
        )


PRESETS = (
    Preset("sparq", "everything in memory; top-r |q| dims approximate scores, exact top t/2, mean-value mix, "
           "token budget t (selection)", selector=SparQ()),
)
