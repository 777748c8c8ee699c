"""Masks for the kvsieve attention path.

The registered mask function hands the model's 2-D padding mask through unchanged: the attention
function builds causal visibility itself from each entry's stored absolute position, which stays
right after eviction (transformers' own masks index held entries by slot and would not).
"""

from __future__ import annotations

import torch


def passthrough_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: object = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor | None:
    """Mask-interface entry for ``"kvsieve"``: return the 2-D ``(batch, seen + q)`` padding mask as is."""
    return attention_mask


def padding_from_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean ``(batch, seen + q)`` padding mask, or None when every token is real."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(
            "kvsieve attention expects a 2-D padding attention_mask of shape (batch, past + new tokens); "
            f"got a {attention_mask.ndim}-D mask. Pass the tokenizer's attention_mask, not a prepared 4-D mask."
        )
    pad = attention_mask.bool()
    return None if bool(pad.all()) else pad


def dense_causal_mask(
    q_len: int,
    kv_len: int,
    pad: torch.Tensor | None,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean ``(batch|1, 1, q, kv)`` mask for queries that are the last ``q_len`` of ``kv_len`` slots.

    Equals transformers' SDPA mask (causal, padding, sliding window); a query that would see nothing
    (a padding query) sees itself, so no row is empty. None when plain causal attention suffices.
    """
    if pad is None and sliding_window is None and q_len in (1, kv_len):
        return None  # plain causal: SDPA's is_causal (or no mask for one query) is exact
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (q_pos - k_pos < sliding_window)
    mask = mask[None, None]
    if pad is not None:
        mask = mask & pad[:, None, None, -kv_len:].to(device)
        mask = mask | (k_pos == q_pos)[None, None]
    return mask
