"""Pure tensor scoring functions: ``(statistics) -> (batch, kv_heads, n)``; no model, no cache inside."""

from kvsieve.scores.attention import attention_rows, column_sums, visibility_mask
from kvsieve.scores.gqa import reduce_groups
from kvsieve.scores.pooling import pool_scores

__all__ = ["attention_rows", "column_sums", "pool_scores", "reduce_groups", "visibility_mask"]
