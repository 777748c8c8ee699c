"""The one attention function kvsieve registers with ``transformers.AttentionInterface``.

Without a :class:`~kvsieve.cache.KVCache` it is plain SDPA (transformers' own
``sdpa_attention_forward`` with the mask transformers would build), so a prepared model behaves
exactly as before. With a ``KVCache``, the layer's new keys/values arrive tagged with their cache
layer; this function appends them to the ragged store, computes the output against every held
entry (causality from stored absolute positions), and lets the policy observe, select or compact.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvsieve.attention.masks import dense_causal_mask, padding_from_mask

#: Attribute that ``KVCache`` layers set on the key tensor they return from ``update``.
LAYER_TAG = "_kvsieve_layer"


def kvsieve_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over the kvsieve cache (or plain SDPA); returns ``(batch, q, q_heads, d)`` and None."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = getattr(key, LAYER_TAG, None)
    if layer is None:
        pad = padding_from_mask(attention_mask)
        mask = dense_causal_mask(query.shape[2], key.shape[2], pad, sliding_window, query.device)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scale, **kwargs)
    return layer.attend(module, query, attention_mask, scale, sliding_window), None
