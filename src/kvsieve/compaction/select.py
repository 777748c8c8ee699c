"""Selection without deletion: attention restricted to a subset of held entries (decoding time)."""

from __future__ import annotations

import torch


def topk_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    k: int,
    scaling: float,
) -> torch.Tensor:
    """Exact attention of one decoding query over its ``k`` largest ``q·k`` entries, per query head.

    ``query`` ``(batch, q_heads, 1, d)``, ``keys``/``values`` ``(batch, kv_heads, L, d)``; returns
    ``(batch, 1, q_heads, d)`` like transformers' attention functions. Nothing is deleted.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups * q_len, dim).float()
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scaling
    if valid is not None:
        logits = logits.masked_fill(~valid.unsqueeze(-2), float("-inf"))
    if k < length:
        threshold = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values).view(batch, q_heads, q_len, dim)
    return out.transpose(1, 2).contiguous()
