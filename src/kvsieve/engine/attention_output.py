"""The attention output of one layer step, after its entries were appended.

* A layer's first prompt on an empty store: plain SDPA on the prompt's own keys (bit-exact with
  transformers), or the model's eager form when SDPA cannot express it (soft-capping, sinks).
* Otherwise, over the held entries with visibility from stored positions and the merge-count bias:
  EMS's centres expanded to the positions they stand for, a selector's subset at decoding (row by row,
  :mod:`kvsieve.engine.row_groups`), or every held entry (at decoding, ragged heads on the CPU in one pass
  over each head's rows, :mod:`kvsieve.native.segment_attention`; elsewhere heads of very different lengths by
  length group, :mod:`kvsieve.engine.grouped_decode`).
"""

from __future__ import annotations

import torch

from kvsieve.attention.kernel import AttentionForm, attend, causal_mask, output_mask
from kvsieve.attention.masks import dense_causal_mask
from kvsieve.cache.dense_view import DenseView
from kvsieve.cache.store import LayerStore
from kvsieve.core.selection import Selection
from kvsieve.core.step import LayerStep
from kvsieve.engine.grouped_decode import grouped_decode_output
from kvsieve.engine.layer_call import LayerCall
from kvsieve.engine.row_groups import select_by_row
from kvsieve.native import segment_attention
from kvsieve.policies.policy import Policy
from kvsieve.transformers_adapter import sdpa_attention


def first_prompt_output(call: LayerCall, step: LayerStep) -> torch.Tensor:
    """Causal attention of a first prompt over its own new entries (nothing held before it)."""
    query = call.query
    mask = dense_causal_mask(step.q_len, step.q_len, call.padding, call.sliding_window, query.device)
    if call.form.explicit:  # soft-capping or sinks: SDPA cannot, so as the model's eager attention
        if mask is None and step.q_len > 1:
            mask = causal_mask(step.q_len, query.device)
        return attend(call.module, query, call.keys, call.values, mask, call.form)
    return sdpa_attention(call.module, query, call.keys, call.values, mask, call.form.scaling)


def held_output(
    policy: Policy, row_configs: dict[int, list[dict[str, int]] | None], call: LayerCall, step: LayerStep,
    compressed: bool = True,
) -> torch.Tensor:
    """Attention over the held entries: expanded centres, a selector's subset (decoding), or all of them.

    ``row_configs`` is the engine's record of each batch row's selector configuration per layer; ``compressed``:
    whether the cache has compacted anything yet (until then it holds what transformers' cache would, and a
    decoding step keeps transformers' own call: :func:`packs_decoding_query`).
    """
    module, sliding_window, left_alone = call.module, call.sliding_window, call.layer.left_alone
    tiered = step.store.tiered  # quantized entries (no merges: a quantizing action does not merge)
    bias = None if tiered else step.bias()
    expanded = None if left_alone or tiered else policy.action.expanded(step)
    if expanded is not None:  # EMS w. pos: centres expanded to the positions they stand for
        keys, values, positions, valid, bias = expanded
        mask = output_mask(lambda: step.query_positions, lambda: positions, valid, sliding_window, step.groups,
                           bias, step.query.dtype, newest_query=step.is_decoding)
        return attend(module, step.query, keys, values, mask, step.form)
    selector = policy.selector
    if selector is not None and step.is_decoding and not left_alone:
        subset = select_by_row(selector, step, row_configs)
        if subset is not None:
            view = step.view
            blend = None
            if isinstance(subset, Selection):  # SparQ: the subset's output mixed with a fallback
                subset, blend = subset.indices, (subset.weight, subset.fallback)
            output = attend(module, step.query, view.keys, view.values, None, step.form,
                            subset=subset, bias=bias, key_valid=view.valid, blend=blend)
            # "t ≥ N → exact attention" per row: a row holding no more than the selector's token budget
            # attends to everything, as it would alone, whatever its neighbours hold
            exact = step.store.lengths().amax(dim=1) <= getattr(selector, "k", 0)  # host: no device sync
            if bool(exact.any()):
                full = all_entries_output(step, module, sliding_window, bias)
                output = torch.where(exact.to(output.device)[:, None, None, None], full, output)
            return output
    if tiered:  # every entry, in the tiers' cheaper unordered view (attention does not depend on the order)
        if step.is_decoding and sliding_window is None and (step.form is None or not step.form.explicit):
            output = step.store.decoding_output(step.query, step.scaling)  # the CPU's pass over the packed tiers
            if output is not None:
                return output
        return all_entries_output(step, module, sliding_window, None, step.store.attention_view())
    return all_entries_output(step, module, sliding_window, bias, compressed=compressed)


def all_entries_output(
    step: LayerStep, module: torch.nn.Module, sliding_window: int | None, bias: torch.Tensor | None,
    view: DenseView | None = None, compressed: bool = True,
) -> torch.Tensor:
    """Attention of the step's queries over every held entry (visibility from stored positions); ``view``
    defaults to the step's dense view (attention does not depend on the order of the entries, so a tiered
    store passes its cheaper unordered :meth:`~kvsieve.cache.store_tiers.StoreTiers.attention_view`)."""
    if view is None:
        if step.is_decoding and sliding_window is None and bias is None and not (step.form and step.form.explicit):
            output = ragged_decoding_output(step.store, step.query, step.scaling)
            if output is not None:
                return output
        view = step.view
    if step.is_decoding and view.valid is None and sliding_window is None and bias is None:
        if compressed and packs_decoding_query(step):
            return packed_decoding_output(step.query, view.keys, view.values, step.scaling)
        return attend(module, step.query, view.keys, view.values, None, step.form)
    if step.is_decoding and sliding_window is None and bias is None and (step.form is None or not step.form.explicit):
        # ragged heads: the newest query sees every valid entry; packed, the validity broadcasts over each KV
        # head's query rows (transformers' masked call repeats every key and value per query head instead)
        assert view.valid is not None
        return packed_decoding_output(step.query, view.keys, view.values, step.scaling, view.valid)
    mask = output_mask(
        lambda: step.query_positions, lambda: view.positions, view.valid, sliding_window, step.groups, bias,
        step.query.dtype, newest_query=step.is_decoding,
    )
    return attend(module, step.query, view.keys, view.values, mask, step.form)


def ragged_decoding_output(store: LayerStore, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """A decoding query's output over a ragged layout read in place. On the CPU (the C helper built) every segment's
    rows in one call, whatever the layout (:mod:`kvsieve.native.segment_attention`: within float32 rounding of SDPA);
    elsewhere by length group (strided runs included) or, for a padded layout, over its buffers with the additive
    validity mask it keeps (no dense view, and no boolean mask for SDPA to convert at every call; what
    :func:`all_entries_output`'s packed masked call computes from the dense view). None for a uniform layout, a store
    with tiers, and off the CPU a compact layout (or a padded one in another dtype)."""
    if not store.is_uniform and not store.tiers:  # on the CPU: each segment's rows where they lie, in one call
        start, held, decoded = store.segment_rows()
        output = segment_attention.attend(query, scaling, store.keys, store.values, start, held, decoded)
        if output is not None:
            return output
    groups = store.length_groups()  # ragged heads of very different lengths: group by length
    if groups is not None:
        return grouped_decode_output(store, query, scaling, groups)
    if store.is_padded and not store.tiers and store.dtype == query.dtype:
        keys, values, mask = store.padded_decoding_views()
        return packed_decoding_output(query, keys, values, scaling, mask)
    return None


def tiered_decoding_output(module: torch.nn.Module, store: LayerStore, query: torch.Tensor, scaling: float,
                           compressed: bool, explicit: bool = False) -> torch.Tensor:
    """A decoding query's output over a store with quantized tiers. On the CPU (``explicit`` False: no soft-capping or
    sinks), :meth:`~kvsieve.cache.store_tiers.StoreTiers.decoding_output` reads the packed tiers in place; elsewhere
    every held entry in the tiers' unordered view (:meth:`~kvsieve.cache.store_tiers.StoreTiers.attention_view`, the
    tiers dequantized into it), released after the call — the calls :func:`held_output` makes for such a store at a
    decoding step (the engine's plain step, which describes nothing, takes it; bit for bit the general step)."""
    if not explicit:  # on the CPU: the packed tiers read in place, no dequantized view
        output = store.decoding_output(query, scaling)
        if output is not None:
            store.release_views()
            return output
    view = store.attention_view()
    if view.valid is None:
        if compressed and packs_query(query, None, view.keys.shape[1]):
            output = packed_decoding_output(query, view.keys, view.values, scaling)
        else:
            output = sdpa_attention(module, query, view.keys, view.values, None, scaling)
    else:
        output = packed_decoding_output(query, view.keys, view.values, scaling, view.valid)
    store.release_views()  # the dequantized view lives for this step only
    return output


def packs_decoding_query(step: LayerStep) -> bool:
    """Whether a decoding step over a compressed layer attends with its GQA group packed into the query axis.

    transformers' SDPA call for a single query without a mask repeats nothing but asks SDPA for grouped-query
    attention (``enable_gqa``), and on a CPU in bfloat16/float16 that kernel takes 4–7× longer per layer than
    one call whose queries are the group's heads over their KV head (measured, 3 KV heads of 64, 128–2,048
    entries: 58 → 14 µs at 128, 881 → 130 µs at 2,048; in float32 the grouped call is as fast, so it stays).
    Only for a cache that has compacted something (the caller's ``compressed``): until then it holds what
    transformers' cache would and keeps transformers' call, bit for bit (``full``, a budget above the prompt).
    """
    return packs_query(step.query, step.form, step.kv_heads)


def packs_query(query: torch.Tensor, form: AttentionForm | None, kv_heads: int) -> bool:
    """:func:`packs_decoding_query` from the query ``(batch, q_heads, 1, d)``, the attention form and the KV heads."""
    if query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float16) or query.shape[1] == kv_heads:
        return False
    return form is None or not form.explicit


def packed_decoding_output(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                           valid: torch.Tensor | None = None) -> torch.Tensor:
    """One decoding query per head over ``keys``/``values`` ``(batch, kv_heads, L, d)``, each KV head's group of
    query heads as the rows of one SDPA call: ``(batch, 1, q_heads, d)``. ``valid`` ``(batch, kv_heads, L)``
    (ragged heads' padded view: a boolean validity, or the additive 0 / −inf mask of a padded layout,
    ``StoreLayout.padded_decoding_views``) masks the padding, one row of it shared by the group's query rows: no key,
    value or mask is repeated per query head (transformers' masked call copies every key and value ``groups``
    times per layer and step). The same output within rounding (bit for bit with torch 2.13 on the CPU), 5–25%
    faster per call at 256–2,048 entries on the CPU; on an H200 ``adakv`` decodes at 1.70× a ``DynamicCache``'s
    step instead of 1.83× (``benchmarks/results/engine_overhead_cuda_views/``)."""
    batch, q_heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    packed = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    mask = None if valid is None else valid.unsqueeze(2)
    out = torch.nn.functional.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, q_heads, dim)
