"""Retention-gated attention for training (TrimKV, Bui et al. 2025, arXiv:2512.03324;
the retention relaxation of Eq. 1 restated in DBTrimKV, Bui et al., 2026, arXiv:2605.09649, Sec. 2.2).

The unnormalised weight of key ``i`` for query ``t ≥ i`` is ``β_i^{t−i}·exp(q_t·k_i/√d)``, i.e. the logit gets the
additive bias ``(t − i)·log β_i``. Computed blockwise over queries: a block of ``block_size`` queries reads
every key up to its last query, so at most ``block_size × N`` logits (and biases) exist at once, never
``N × N``; each block runs under activation checkpointing, so the backward pass keeps only the block's
inputs and recomputes its softmax. The same blocks give the retention mass ``Σ_{i≤t} β_i^{t−i}`` per query
and head that the capacity loss reads (Sec. 2.2, Eq. 4). GQA: query head ``j`` reads KV head
``j // groups`` and its gate. All ``β = 1`` (``log β = 0``) is plain causal attention.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _block(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_beta: torch.Tensor, start: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[start, start + q)`` over keys ``[0, start + q)``.

    Returns outputs ``(B, Hkv, g, q, d)`` and retention masses ``(B, Hkv, q)``.
    """
    q_len = query.shape[3]
    n_keys = key.shape[2]
    t = torch.arange(start, start + q_len, device=query.device)
    i = torch.arange(n_keys, device=query.device)
    age = (t[:, None] - i[None, :]).to(log_beta.dtype)  # (q, n)
    visible = age >= 0
    bias = age.clamp(min=0) * log_beta[:, :, None, :]  # (B, Hkv, q, n)
    bias = bias.masked_fill(~visible, float("-inf"))
    logits = torch.matmul(query.float(), key.float().transpose(-1, -2).unsqueeze(2)) * scaling  # (B, Hkv, g, q, n)
    weights = torch.softmax(logits + bias[:, :, None], dim=-1)
    out = torch.matmul(weights, value.float().unsqueeze(2))
    mass = torch.exp(bias).sum(dim=-1)  # Σ_{i≤t} β_i^{t−i}
    return out, mass


def gated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_beta: torch.Tensor,
    scaling: float,
    block_size: int = 256,
    use_checkpoint: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention with the retention bias: ``(B, Hq, N, d)`` outputs (query dtype), masses ``(B, Hkv, N)``.

    Args:
        query: ``(B, Hq, N, d)``; key, value: ``(B, Hkv, N, d)`` (the same ``N`` tokens, causal).
        log_beta: ``(B, Hkv, N)`` ``log β`` of each key (≤ 0).
        scaling: the logit scale (``1/√d`` for most models).
        block_size: queries per block (memory ``B·Hq·block_size·N`` floats per block).
        use_checkpoint: recompute each block in the backward pass instead of keeping its softmax.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be an int ≥ 1; got {block_size!r}")
    batch, q_heads, n, dim = query.shape
    kv_heads = key.shape[1]
    if q_heads % kv_heads or key.shape[2] != n or log_beta.shape != (batch, kv_heads, n):
        raise ValueError(
            f"gated_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and log_beta {tuple(log_beta.shape)} "
            "must be (B, Hq, N, d), (B, Hkv, N, d) and (B, Hkv, N) with Hq a multiple of Hkv"
        )
    grouped = query.view(batch, kv_heads, q_heads // kv_heads, n, dim)
    outs, masses = [], []
    for lo in range(0, n, block_size):
        hi = min(lo + block_size, n)
        args = (grouped[:, :, :, lo:hi], key[:, :, :hi], value[:, :, :hi], log_beta[:, :, :hi].float(), lo, scaling)
        needs_grad = torch.is_grad_enabled() and any(a.requires_grad for a in args[:4])
        if use_checkpoint and needs_grad:
            out, mass = checkpoint(_block, *args, use_reentrant=False)
        else:
            out, mass = _block(*args)
        outs.append(out)
        masses.append(mass)
    output = torch.cat(outs, dim=3).reshape(batch, q_heads, n, dim).to(query.dtype)
    return output, torch.cat(masses, dim=-1)


def dense_gated_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_beta: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Reference: the full ``N × N`` biased softmax (tests only)."""
    n, groups = query.shape[2], query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    lb = log_beta.repeat_interleave(groups, dim=1).float()
    t = torch.arange(n)
    age = (t[:, None] - t[None, :]).float()
    bias = (age.clamp(min=0) * lb[:, :, None, :]).masked_fill(age < 0, float("-inf"))
    weights = torch.softmax(query.float() @ k.transpose(-1, -2) * scaling + bias, dim=-1)
    return (weights @ v).to(query.dtype)
