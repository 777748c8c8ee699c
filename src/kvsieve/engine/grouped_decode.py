"""A decoding step over a ragged layer, attended group by group of similar head lengths.

When one padded view would be mostly padding (:mod:`kvsieve.cache.length_groups`: DuoAttention's whole
retrieval heads next to short streaming heads, a global budget's long and short heads), each group of
segments is gathered to its own width and attended on its own: every segment becomes one batch item whose
``groups`` query heads are the query rows of one attention call (a single decoding query per head, so the
rows are independent), and the outputs are put back in head order. The result is the attention of each
query head over its KV head's held entries, as the padded view gives it, computed over less padding; a
group of one segment, or (on a CPU) of segments all holding at least ``IN_PLACE_LENGTH`` entries, is
attended segment by segment where its entries lie (no gather: copying a long head costs more than a call);
on a CPU with several threads a head of at least ``SPLIT_DECODING_LENGTH`` entries is cut across them
(:func:`~kvsieve.attention.kernel.split_decoding_attention`: one call runs on one thread). A layout cut into
strided runs (``StoreCompaction.plan_runs``) has each group's segments back to back with one capacity: the group is
attended as a view of the buffers with its rows' validity, no gather; the views and the run order are built once per
layout (``StoreLayout.run_views``), so a step reorders its queries and outputs with one index each, or none. On a
CPU, strided runs of a layer with few segments (batch 1: ``length_groups.ONE_CALL_SEGMENTS``) are attended in one call
over the whole buffer instead, each query row masked to its own segment's entries (``StoreLayout.one_call_mask``):
the same attention, rounded as one call over more (masked) rows rounds it.
"""

from __future__ import annotations

import torch

from kvsieve.attention.kernel import split_decoding_attention, splits_decoding
from kvsieve.cache import length_groups
from kvsieve.cache.length_groups import LengthGroup
from kvsieve.cache.store import LayerStore


def grouped_decode_output(store: LayerStore, query: torch.Tensor, scaling: float,
                          groups: list[tuple[LengthGroup, int]]) -> torch.Tensor:
    """Attention output ``(batch, 1, q_heads, d)`` of a decoding query over every held entry, by length group."""
    batch, q_heads, _, dim = query.shape
    per_head = q_heads // store.heads  # query heads per stored head
    queries = query.reshape(store.segments, per_head, dim)
    if groups[0][0].base is not None:  # strided runs (a layout's groups are all runs or none)
        return _runs_output(store, groups, queries, scaling).view(batch, 1, q_heads, dim)
    output = torch.empty(store.segments, per_head, dim, dtype=query.dtype, device=query.device)
    lengths: list[int] = []
    starts: list[int] = []
    for group, width in groups:
        members = group.device_segments
        count = len(group.members)
        if not lengths:
            lengths, starts = store.length.tolist(), store.start.tolist()  # host bookkeeping, read once
        shortest = min(lengths[segment] for segment in group.members)
        if count == 1 or (shortest >= length_groups.IN_PLACE_LENGTH and query.device.type == "cpu"):
            # long heads: each segment's entries are contiguous rows of the buffers, attended where they are
            for segment in group.members:
                start, held = starts[segment], lengths[segment]
                keys, values = store.keys[start : start + held], store.values[start : start + held]
                output[segment] = _one_head(queries[segment], keys, values, scaling)
            continue
        index, valid, _ = store.gather_index()  # cached; only a gathered group reads it
        rows = index.index_select(0, members)[:, :width].reshape(-1)
        keys = store.keys.index_select(0, rows).view(count, 1, width, dim)
        values = store.values.index_select(0, rows).view(count, 1, width, dim)
        mask = None if group.equal else valid.index_select(0, members)[:, None, None, :width]
        group_query = queries.index_select(0, members).view(count, 1, per_head, dim)
        out = torch.nn.functional.scaled_dot_product_attention(group_query, keys, values, attn_mask=mask,
                                                               scale=scaling)
        output.index_copy_(0, members, out.view(count, per_head, dim))
    return output.view(batch, 1, q_heads, dim)


def _runs_output(store: LayerStore, groups: list[tuple[LengthGroup, int]], queries: torch.Tensor, scaling: float
                 ) -> torch.Tensor:
    """Attention output ``(segments, per_head, d)`` of a layout cut into strided runs: each run one SDPA call over
    its zero-copy view — narrowed to its width where its members hold as many entries (a run of one head of at least
    ``SPLIT_DECODING_LENGTH`` entries: split across the threads), else whole with its rows' validity (the slack rows
    are invalid: masked, a few more slots instead of three views per step) — the queries put in run order and the
    outputs back in segment order with one index each (none where the runs lie in segment order). On a CPU with few
    segments and no head long enough to split, one call over the whole buffer instead (:func:`_one_call_output`)."""
    segments, per_head, dim = queries.shape
    longest = max(width for _, width in groups)  # a head cut across the threads keeps its own call
    if length_groups.attends_in_one_call(segments, queries.device) and not splits_decoding(longest, queries.device):
        return _one_call_output(store, queries, scaling)
    views = store.run_views()
    if views.order is not None:
        queries = queries.index_select(0, views.order)
    outputs = []
    for (group, width), query, keys, values, bias in zip(groups, queries.split(views.sizes), views.keys,
                                                         views.values, views.bias, strict=True):
        count = len(group.members)
        if bias is None:  # members of one length (a run of one head included): their rows, no mask
            keys, values = keys.narrow(2, 0, width), values.narrow(2, 0, width)
            if count == 1:  # one head: split across the threads where that pays
                outputs.append(_one_head(query[0], keys[0, 0], values[0, 0], scaling).view(1, 1, per_head, dim))
                continue
        # else the validity masks every row past a member's entries, slack included: the whole stride, as it lies
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query.view(count, 1, per_head, dim), keys, values, attn_mask=bias, scale=scaling))
    output = torch.cat(outputs).view(-1, per_head, dim)
    return output if views.inverse is None else output.index_select(0, views.inverse)


def _one_call_output(store: LayerStore, queries: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention output ``(segments, per_head, d)`` of a layout's decoding queries in one call over its whole buffer:
    the ``segments · per_head`` query rows are the rows of one SDPA call, each masked to the rows its segment holds
    (``StoreLayout.one_call_mask``, kept by the appends: slack and other segments' rows are −inf, so they add exact
    zeros)."""
    segments, per_head, dim = queries.shape
    rows = store.keys.shape[0]
    mask = store.one_call_mask(per_head).view(1, 1, segments * per_head, rows)
    output = torch.nn.functional.scaled_dot_product_attention(
        queries.reshape(1, 1, segments * per_head, dim), store.keys.view(1, 1, rows, dim),
        store.values.view(1, 1, rows, dim), attn_mask=mask, scale=scaling)
    return output.view(segments, per_head, dim)


def _one_head(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """One KV head's query rows ``(rows, d)`` over its entries ``(n, d)`` (contiguous rows, read in place); a long
    head on a CPU is cut across the threads (:func:`~kvsieve.attention.kernel.split_decoding_attention`)."""
    split = split_decoding_attention(query, keys, values, scaling)
    if split is not None:
        return split
    rows, dim = query.shape
    held = keys.shape[0]
    out = torch.nn.functional.scaled_dot_product_attention(query.view(1, 1, rows, dim), keys.view(1, 1, held, dim),
                                                           values.view(1, 1, held, dim), scale=scaling)
    return out.view(rows, dim)
