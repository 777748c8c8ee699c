"""Attention statistics computed only for the rows a scorer needs, never an N×N matrix.

``attention_rows`` gives the softmax rows of a few queries (an observation window, or the single
decoding query) over all cached keys; ``column_sums`` gives ``Σ_t A[t, j]`` over many queries
(H2O's accumulated attention, Zhang et al. 2023, Eq. 1) by processing queries in blocks, so peak
extra memory is ``block × n`` per head.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 256


def visibility_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean ``(batch, kv_heads, q, n)`` mask: key visible iff ``pos_k ≤ pos_q`` (and inside the window).

    ``key_positions`` is ``(batch, kv_heads, n)``; ``key_valid`` marks real (non-padding) entries.
    Positions are absolute slots in the token stream, so the mask stays right after eviction.
    """
    qp = query_positions.view(1, 1, -1, 1)
    kp = key_positions.unsqueeze(-2)
    mask = kp <= qp
    if sliding_window is not None:
        mask = mask & (qp - kp < sliding_window)
    if key_valid is not None:
        mask = mask & key_valid.unsqueeze(-2)
    return mask


def _grouped_logits(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``q·k`` logits ``(batch, kv_heads, groups, q, n)`` in float32 for GQA without repeating keys."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = keys.shape[1]
    groups = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups * q_len, dim).float() * scaling  # scale the small side
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2))
    return logits.view(batch, kv_heads, groups, q_len, keys.shape[2])


def attention_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Softmax attention ``(batch, q_heads, q, n)`` in float32 of ``query`` over ``keys``.

    ``mask`` (broadcastable to ``(batch, kv_heads, q, n)``) comes from :func:`visibility_mask`.
    Rows with no visible key (padding queries) are all zero.
    """
    batch, q_heads, q_len, _ = query.shape
    logits = _grouped_logits(query, keys, scaling)
    logits.masked_fill_(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not bool(mask.any(dim=-1).all()):  # a row with no visible key is NaN after softmax
        probs = torch.nan_to_num(probs, nan=0.0)
    return probs.view(batch, q_heads, q_len, keys.shape[2])


def column_sums(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    query_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_t w_t · A[t, j]`` over all queries ``t``, shape ``(batch, q_heads, n)``, computed blockwise.

    ``query_weight`` ``(batch, q)`` zeroes padding queries (None: all weigh 1). Each block of queries
    only reads the keys up to the last one any of its queries can see (under a causal prefill, about
    half the work); the keys past it would only add exact zeros.
    """
    q_len = query.shape[2]
    total = torch.zeros(query.shape[0], query.shape[1], keys.shape[2], dtype=torch.float32, device=query.device)
    for lo in range(0, q_len, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, q_len)
        block_mask = mask[:, :, lo:hi]
        seen = block_mask.flatten(0, -2).any(dim=0).nonzero()
        if seen.numel() == 0:
            continue
        limit = int(seen[-1]) + 1
        rows = attention_rows(query[:, :, lo:hi], keys[:, :, :limit], block_mask[..., :limit], scaling)
        if query_weight is not None:
            rows = rows * query_weight[:, None, lo:hi, None].to(rows.dtype)
        total[..., :limit] += rows.sum(dim=2)
    return total
