"""What the decoding-time sparse selectors share (Quest, SparQ, HSA): budgets, per-store state, page→token top-k.

**Token budget** (RocketKV, Behnam et al., 2025, arXiv:2502.14051, Sec. 3.6): ``t`` counts *all* KV traffic of one
decoding step of one KV group, in key+value pairs (``2·d`` elements), the approximation step included;
it is split evenly: ``t/2`` for approximating the scores and ``t/2`` tokens for exact attention.
Compression ratio ``c = N / t`` for ``N`` held entries. When ``t ≥ N`` a selector attends to everything
(exactly full attention; reading every entry costs ``N ≤ t``).

**Measured traffic**: every selector's select adds the bytes it reads (keys, values, page min/max,
mean value) to its store's :class:`SelectionState`, next to what full attention would have read;
``KVCache.traffic()`` totals them. No host sync on the hot path: data-dependent counts stay tensors.
"""

from __future__ import annotations

import math

import torch


def split_budget(budget: int) -> int:
    """Tokens given exact attention: half the token budget (the other half pays for the approximation)."""
    return max(budget // 2, 1)


def rocket_split(ratio: float) -> float:
    """RocketKV's split factor ``r = min(0.2 + 0.06·log2 c, 0.8)`` (Sec. 3.6) for a compression ratio ``c ≥ 1``."""
    return min(0.2 + 0.06 * math.log2(max(ratio, 1.0)), 0.8)


def grouped_query(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The decoding query ``(batch, q_heads, 1, d)`` as float32 ``(batch, kv_heads, groups, d)``."""
    batch, q_heads, _, dim = query.shape
    return query.reshape(batch, kv_heads, q_heads // kv_heads, dim).float()


def per_query_head(indices: torch.Tensor, groups: int) -> torch.Tensor:
    """``(batch, kv_heads, k)`` group selections as ``(batch, q_heads, k)`` (every head of a group the same)."""
    return indices.repeat_interleave(groups, dim=1)


def top_tokens_of_pages(
    page_scores: torch.Tensor,
    page_size: int,
    length: int,
    k: int,
    token_valid: torch.Tensor | None,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``k`` tokens of the best pages: ``(batch, kv_heads, k)`` token indices.

    Every token gets its page's score (``page_scores`` ``(batch, kv_heads, slots)``; token ``j`` is in page
    ``j // page_size``), padding tokens ``-inf``, ``forced`` tokens ``+inf``; the top ``k`` are taken, so
    whole pages are taken best first and the last one may be taken in part — its first tokens: the tokens
    of a page tie, and a stable sort breaks the tie by position, whatever the row's padded length (a top-k
    would break it by an implementation detail that depends on the batch).
    """
    page_of = torch.arange(length, device=page_scores.device) // page_size
    scores = page_scores.index_select(-1, page_of)
    if forced is not None:
        scores = scores.masked_fill(forced, math.inf)
    if token_valid is not None:
        scores = scores.masked_fill(~token_valid, -math.inf)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : min(k, length)]


def last_page_tokens(lengths: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """``(batch, kv_heads, length)`` True for the tokens of each segment's last (maybe partial) page."""
    offsets = torch.arange(length, device=lengths.device)
    first_of_last = ((lengths - 1).clamp(min=0) // page_size) * page_size
    return (offsets[None, None, :] >= first_of_last[..., None]) & (offsets[None, None, :] < lengths[..., None])


def page_valid(kmax: torch.Tensor) -> torch.Tensor:
    """``(…, slots)`` True for page slots holding at least one entry (unused slots have ``-inf`` max)."""
    return kmax[..., 0] > -math.inf
