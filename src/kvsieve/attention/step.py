"""What one attention layer saw in one forward call: the input every policy hook reads.

Statistics are computed lazily and memoised, only for the rows a policy asks for (window queries,
the last query), never as an N×N matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvsieve.cache.store import DenseView, RaggedLayerStore
from kvsieve.models.architectures import ModelInfo
from kvsieve.scores.attention import attention_rows, column_sums, visibility_mask


@dataclass
class LayerStep:
    """One forward of one layer, after the new entries were appended to the store.

    ``query`` is ``(batch, q_heads, q, d)`` (post-RoPE), ``query_positions`` the absolute slots of the
    queries ``(q,)``, ``query_valid`` ``(batch, q)`` marks non-padding queries (None: all real).
    ``view`` is the dense view of every entry the layer holds, the new ones included.
    """

    module: torch.nn.Module
    layer_idx: int
    info: ModelInfo
    query: torch.Tensor
    query_positions: torch.Tensor
    query_valid: torch.Tensor | None
    store: RaggedLayerStore
    view: DenseView
    scaling: float
    sliding_window: int | None = None
    forward_index: int = 0
    _memo: dict[object, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def is_decoding(self) -> bool:
        """A single-token forward (generation step) rather than a prompt chunk."""
        return self.q_len == 1

    def lengths(self) -> torch.Tensor:
        """Entries held per (batch, KV head), on the store's device."""
        return self.store.length.view(self.store.batch, self.store.heads).to(self.view.keys.device)

    def entry_valid(self) -> torch.Tensor:
        """``(batch, kv_heads, L)`` True for real entries of the dense view."""
        if self.view.valid is not None:
            return self.view.valid
        return torch.ones(self.view.positions.shape, dtype=torch.bool, device=self.view.positions.device)

    def window_rows(self, window: int) -> torch.Tensor:
        """Softmax rows ``(batch, q_heads, w, L)`` of the last ``min(window, q)`` queries (float32).

        Rows of padding queries are zero.
        """
        w = min(window, self.q_len)
        key = ("rows", w)
        if key not in self._memo:
            positions = self.query_positions[-w:]
            mask = visibility_mask(positions, self.view.positions, self.view.valid, self.sliding_window)
            rows = attention_rows(self.query[:, :, -w:], self.view.keys, mask, self.scaling)
            if self.query_valid is not None:
                rows = rows * self.query_valid[:, None, -w:, None].to(rows.dtype)
            self._memo[key] = rows
        return self._memo[key]

    def window_outputs(self, window: int) -> torch.Tensor:
        """Per-query-head attention outputs before ``W_O``, ``o_t = Σ_j A[t, j] v_j``, ``(batch, q_heads, w, d)``.

        Computed in float32 from :meth:`window_rows` and the dense view's values (query head ``i`` reads
        KV head ``i // groups``), so no second attention pass; rows of padding queries give zeros.
        """
        rows = self.window_rows(window)
        key = ("outputs", rows.shape[2])
        if key not in self._memo:
            batch, q_heads, w, length = rows.shape
            values = self.view.values.float()
            if self.view.valid is not None:
                values = values.masked_fill(~self.view.valid.unsqueeze(-1), 0.0)
            kv_heads = values.shape[1]
            grouped = rows.reshape(batch, kv_heads, (q_heads // kv_heads) * w, length)
            self._memo[key] = torch.matmul(grouped, values).view(batch, q_heads, w, values.shape[-1])
        return self._memo[key]

    def all_column_sums(self) -> torch.Tensor:
        """``Σ_t A[t, j]`` over every (non-padding) query of this forward, ``(batch, q_heads, L)``."""
        if "colsum" not in self._memo:
            if self.q_len == 1:
                self._memo["colsum"] = self.window_rows(1)[:, :, 0]
            else:
                mask = visibility_mask(
                    self.query_positions, self.view.positions, self.view.valid, self.sliding_window
                )
                self._memo["colsum"] = column_sums(
                    self.query, self.view.keys, mask, self.scaling, self.query_valid
                )
        return self._memo["colsum"]
