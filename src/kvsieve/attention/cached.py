"""Attention of one layer over its ragged kvsieve store, plus the policy hooks.

Order of work in one forward of one layer: append the new (non-padding) entries; compute the output
(the policy may replace it at decoding, e.g. ``exact_topk``); let the policy observe; compact when the
schedule fires. Compaction happens after the output is computed, so a prompt always attends to its
whole self (SnapKV-style prefill compression).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvsieve.attention.masks import dense_causal_mask, padding_from_mask
from kvsieve.attention.step import LayerStep
from kvsieve.scores.attention import visibility_mask

if TYPE_CHECKING:
    from kvsieve.cache.kv_cache import KVLayer


def _store_mask(step: LayerStep, groups: int) -> torch.Tensor | None:
    """Visibility of held entries for the queries, ``(batch, q_heads, q, L)``; None if all visible."""
    view = step.view
    if step.q_len == 1 and view.valid is None and step.sliding_window is None:
        return None
    mask = visibility_mask(step.query_positions, view.positions, view.valid, step.sliding_window)
    empty_row = ~mask.any(dim=-1, keepdim=True)
    fallback = empty_row if view.valid is None else empty_row & view.valid.unsqueeze(-2)
    mask = mask | fallback
    return mask.repeat_interleave(groups, dim=1)


def attend_cached(
    layer: KVLayer,
    module: torch.nn.Module,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Append, attend, observe and maybe compact; returns ``(batch, q, q_heads, d)``.

    Under the ``blockwise`` schedule a long forward is processed in blocks of ``block_size`` queries,
    compacting after each block, so the layer never holds more than ``budget + block_size`` entries per
    head. Block by block *per layer* is the same computation as feeding the model one block at a time
    (block ``i`` of layer ``l`` only depends on layer ``l``'s cache after block ``i - 1`` and on layer
    ``l - 1``'s output for block ``i``), so ``generate`` needs no special argument; the only transient
    is this layer's keys/values for the whole forward, which ``generate(..., prefill_chunk_size=m)``
    bounds as well.
    """
    new_keys, new_values = layer.take_pending()
    q_len, seen = query.shape[2], layer.seen
    pad = padding_from_mask(attention_mask)
    if attention_mask is not None and attention_mask.shape[-1] < seen + q_len:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} tokens but the cache has seen {seen} and this "
            f"call adds {q_len}; pass the mask of all tokens so far (shape (batch, {seen + q_len}))"
        )
    policy = layer.cache.policy
    block = policy.block_size if policy.schedule == "blockwise" and not layer.left_alone else q_len
    outputs = []
    for lo in range(0, q_len, block):
        hi = min(lo + block, q_len)
        chunk_pad = None if pad is None else pad[:, : seen + hi]
        outputs.append(_attend_chunk(
            layer, module, query[:, :, lo:hi], new_keys[:, :, lo:hi], new_values[:, :, lo:hi],
            chunk_pad, scaling, sliding_window,
        ))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _append_step(
    layer: KVLayer,
    module: torch.nn.Module,
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    pad: torch.Tensor | None,
    scaling: float,
    sliding_window: int | None,
    memo: dict[object, torch.Tensor] | None = None,
) -> LayerStep:
    """Append this chunk's (non-padding) entries and describe the forward as a :class:`LayerStep`.

    ``memo`` shares the step's lazily computed statistics with other steps over identical entries.
    """
    q_len, seen = query.shape[2], layer.seen
    token_valid = None if pad is None else pad[:, seen : seen + q_len]
    if token_valid is not None and bool(token_valid.all()):
        token_valid = None
    store = layer.store
    assert store is not None
    positions = torch.arange(seen, seen + q_len, device=query.device)
    store.append(new_keys, new_values, positions, token_valid)
    layer.seen = seen + q_len
    step = LayerStep(
        module=module, layer_idx=layer.layer_idx, info=layer.cache.info, query=query,
        query_positions=positions, query_valid=token_valid, store=store, view=store.dense(),
        scaling=scaling, sliding_window=sliding_window, forward_index=layer.forwards,
    )
    if memo is not None:
        step._memo = memo
    layer.forwards += 1
    return step


def _after_output(layer: KVLayer, step: LayerStep, sliding_window: int | None) -> None:
    """Policy observation and compaction (managed layers), then the sliding-window trim."""
    cache = layer.cache
    if not layer.left_alone:
        cache.policy.observe(step)
        compressed = cache.policy.should_compress(step) and cache.compact(layer, step)
        cache.note_forward(layer, step, compressed)
    if sliding_window is not None:
        # The next query (position ``seen``) sees keys at positions > seen - window: drop older ones.
        step.store.keep_positions_after(layer.seen - sliding_window + 1)


def _attend_chunk(
    layer: KVLayer,
    module: torch.nn.Module,
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    pad: torch.Tensor | None,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One forward (or one block of it) of one layer: ``pad`` covers every slot up to this chunk's end."""
    q_len, seen = query.shape[2], layer.seen
    assert layer.store is not None
    was_empty = int(layer.store.length.sum()) == 0
    step = _append_step(layer, module, query, new_keys, new_values, pad, scaling, sliding_window)
    policy = layer.cache.policy
    output = policy.decode_attention(step) if not layer.left_alone and step.is_decoding else None
    if output is None:
        if was_empty and seen == 0:
            mask = dense_causal_mask(q_len, q_len, pad, sliding_window, query.device)
            output, _ = sdpa_attention_forward(module, query, new_keys, new_values, mask, scaling=scaling)
        else:
            mask = _store_mask(step, layer.cache.info.groups)
            output, _ = sdpa_attention_forward(
                module, query, step.view.keys, step.view.values, mask, scaling=scaling
            )
    _after_output(layer, step, sliding_window)
    return output


def observe_first_forward(
    layer: KVLayer,
    module: torch.nn.Module,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    sliding_window: int | None,
    memo: dict[object, torch.Tensor] | None = None,
) -> None:
    """A shared prefill's follower: store, observe and compact a prompt whose output another cache computed.

    Only valid for a layer's first forward of more than one token on an empty store under a
    non-blockwise schedule: its output would then be plain causal attention over the prompt itself,
    the same for every cache, so it is computed once by the lead (see
    :func:`kvsieve.cache.shared_prefill.prefill_shared`, which checks these conditions). Before its
    compaction every follower holds exactly the prompt's entries, so followers pass one ``memo``: window
    rows, window outputs and column sums are computed once for all of them.
    """
    new_keys, new_values = layer.take_pending()
    assert layer.seen == 0 and query.shape[2] > 1, "observe_first_forward: not a first prompt forward"
    pad = padding_from_mask(attention_mask)
    step = _append_step(layer, module, query, new_keys, new_values, pad, scaling, sliding_window, memo)
    _after_output(layer, step, sliding_window)
