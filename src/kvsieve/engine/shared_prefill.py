"""One prompt forward filling several compressed caches: the comparison of many policies at the price of one.

Under every schedule but ``blockwise``, the first forward of a prompt on an empty cache attends to the
whole prompt *before* any compaction (SnapKV-style prefill compression), so its hidden states and
logits do not depend on the policy. Only what each cache keeps afterwards does. A method comparison
on one prompt can therefore run the model once: the *lead* cache computes the attention output of
every layer, and each *follower* stores the same keys and values, lets its own policy observe the
same queries (window rows, column sums, reconstruction scores...) and compacts. Every cache ends in
the state its own prefill would have left, bit for bit (``tests/test_shared_prefill.py``), and goes
on independently (decoding, teacher forcing).

The cost is one model forward plus, per follower, its policy's scoring and compaction, instead of
one model forward per policy: on SmolLM2 at 4k tokens, the forward is most of a prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvsieve.engine.kv_cache import KVCache
from kvsieve.transformers_adapter import cache_kwargs


def check_shareable(model: torch.nn.Module, caches: Sequence[KVCache]) -> None:
    """Raise ``ValueError`` unless ``caches`` can share one first prompt forward of ``model``."""
    if not caches:
        raise ValueError("caches: give at least one KVCache")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("caches: the same cache object appears twice")
    for i, cache in enumerate(caches):
        if not isinstance(cache, KVCache):
            raise ValueError(f"caches[{i}]: expected a KVCache; got {type(cache).__name__}")
        if cache.model_config is not model.config:
            raise ValueError(f"caches[{i}] was built for another model")
        if cache.get_seq_length() != 0:
            seen = cache.get_seq_length()
            raise ValueError(f"caches[{i}] is not empty (it has seen {seen} tokens); use fresh caches")
        if cache.policy.schedule.name == "blockwise":
            raise ValueError(
                f"caches[{i}] ({cache.policy.name}) uses the 'blockwise' schedule, whose prompt outputs depend on "
                "its evictions; prefill it on its own"
            )
        if cache.policy.fuse_statistics:
            raise ValueError(
                f"caches[{i}] ({cache.policy.name}) fuses its statistics into the attention pass, whose prompt "
                "outputs differ from SDPA's by float rounding; prefill it on its own"
            )


def prefill_shared(
    model: torch.nn.Module, input_ids: torch.Tensor, caches: Sequence[KVCache], **forward_kwargs: Any
) -> Any:
    """Run ``model(input_ids, cache=caches[0], ...)`` once and fill every cache from it.

    Args:
        model: the model every cache was built for.
        input_ids: the prompt, ``(batch, tokens)`` with ``tokens ≥ 2``.
        caches: fresh :class:`KVCache` objects of that model, none with the ``blockwise`` schedule.
        **forward_kwargs: passed to the model (``attention_mask``, ``logits_to_keep``...).

    Returns the model output, which is every cache's own prefill output. If the forward fails, every
    cache is reset to empty.
    """
    check_shareable(model, caches)
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids: expected (batch, tokens) with tokens ≥ 2; got shape {tuple(input_ids.shape)}")
    lead, followers = caches[0], caches[1:]
    for idx, layer in enumerate(lead.layers):
        layer.followers = [c.layers[idx] for c in followers]
    try:
        with torch.no_grad():  # a KVCache does not support autograd
            return model(input_ids=input_ids, **cache_kwargs(model, lead), use_cache=True, **forward_kwargs)
    except BaseException:
        for cache in caches:
            cache.reset()
        raise
    finally:
        for layer in lead.layers:
            layer.followers = []
