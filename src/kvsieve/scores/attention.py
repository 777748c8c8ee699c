"""Attention statistics for scorers (re-exported from :mod:`kvsieve.attention.kernel`, the one kernel)."""

from kvsieve.attention.kernel import QUERY_BLOCK, attention_rows, column_sums, visibility_mask

__all__ = ["QUERY_BLOCK", "attention_rows", "column_sums", "visibility_mask"]
