"""KVzip's context reconstruction (Kim et al. 2025, arXiv:2505.23416, Sec. 3.2–3.3): score a prefilled context
by making the model repeat it, then compress the cache once.

:func:`reconstruct` runs after the context's prefill on a cache whose scorer reads a reconstruction
(``kvzip``). The context is cut into chunks of the scorer's ``chunk_size`` tokens; each chunk is fed as a
*probe* (:mod:`kvsieve.engine.probe`) — the repeat prompt (the first chunk) or the continuation prompt with the
previous chunk's last ``overlap`` tokens (later chunks), the prompt suffix, then the chunk itself — so every
context entry gets the largest attention a repeating query pays it. Probe tokens are never kept; the last
probe plans the compaction, applied before :func:`reconstruct` returns.

Batches: each row repeats its own real tokens (right-padded probes, so a row's probe tokens follow its context
with no padding between them — sliding-window layers see the distances the row alone sees — and explicit
positions continuing the row);
a row with fewer chunks than the longest repeats its last chunk (the same probe gives the same maxima), so
every row keeps what it would keep alone.
"""

from __future__ import annotations

from typing import Any

import torch

from kvsieve.engine.kv_cache import KVCache
from kvsieve.engine.probe import probing
from kvsieve.transformers_adapter import cache_kwargs


def reads_reconstruction(cache: Any) -> bool:
    """Whether ``cache`` is a :class:`KVCache` whose scorer is scored by a context reconstruction."""
    scorer = getattr(getattr(cache, "policy", None), "scorer", None)
    return isinstance(cache, KVCache) and bool(getattr(scorer, "RECONSTRUCTS", False))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _row_chunks(tokens: list[int], size: int) -> list[list[int]]:
    return [tokens[i : i + size] for i in range(0, len(tokens), size)] or [[]]


def reconstruct(
    model: Any, tokenizer: Any, cache: KVCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> None:
    """Score the context the cache holds by reconstruction, then compress it (see the module docstring).

    Args:
        model, tokenizer: the model the cache was prefilled with, and its tokenizer (for the repeat prompts).
        cache: a :class:`KVCache` of a reconstructing policy (``kvzip``) holding exactly ``input_ids``.
        input_ids: ``(batch, n)`` the prefilled context; ``attention_mask``: its padding mask (None: no padding).
        position_ids: ``(batch, n)`` the rotary positions the context was prefilled with; each row's probe
            continues from its last one. Default: ``generate``'s numbering, each row's real tokens from 0
            (``attention_mask.cumsum(-1) − 1``); a plain forward without ``position_ids`` numbers slots
            instead (``arange(n)`` for every row), which differs for left-padded rows — pass it then.

    Raises:
        ValueError: a cache of another policy, or one that does not hold exactly these tokens (checked before
            any forward).
    """
    if not reads_reconstruction(cache):
        raise ValueError("cache: reconstruct() needs a KVCache whose scorer reads a context reconstruction (kvzip)")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected (batch, n ≥ 1) token ids; got shape {tuple(input_ids.shape)}")
    batch, slots = input_ids.shape
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)}; got {tuple(attention_mask.shape)}")
    if position_ids is not None and position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids: expected shape {tuple(input_ids.shape)}; got {tuple(position_ids.shape)}")
    if cache.get_seq_length() != slots:
        raise ValueError(f"cache: holds {cache.get_seq_length()} tokens, input_ids has {slots}; reconstruct() "
                         "runs right after the context's prefill, on the same ids")
    scorer = cache.policy.scorer
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
    rows = [input_ids[b][mask[b].bool()].tolist() for b in range(batch)]
    chunks = [_row_chunks(tokens, scorer.chunk_size) for tokens in rows]
    rounds = max(len(c) for c in chunks)
    first = _encode(tokenizer, scorer.repeat_prompt)
    later = _encode(tokenizer, scorer.continue_prompt)
    suffix = _encode(tokenizer, scorer.prompt_suffix)
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    device = input_ids.device
    if position_ids is None:
        next_position = torch.tensor([len(t) for t in rows], device=device)
    else:
        next_position = position_ids[:, -1].to(device).long() + 1
    with torch.no_grad():  # not inference_mode: the store stays updatable by a caller outside it
        for r in range(rounds):
            probes = []
            for row_chunks in chunks:
                c = min(r, len(row_chunks) - 1)  # a row out of chunks repeats its last one (same maxima)
                tail = row_chunks[c - 1][max(len(row_chunks[c - 1]) - scorer.overlap, 0):] if c else []
                head = later + tail if c else first
                probes.append(head + suffix + row_chunks[c])
            width = max(len(p) for p in probes)
            ids = torch.full((batch, width), pad, dtype=torch.long, device=device)
            probe_mask = torch.zeros((batch, width), dtype=mask.dtype, device=device)
            for b, probe in enumerate(probes):  # right-padded: a row's probe starts right after its context
                ids[b, : len(probe)] = torch.tensor(probe, dtype=torch.long, device=device)
                probe_mask[b, : len(probe)] = 1
            positions = (next_position[:, None] + probe_mask.long().cumsum(dim=1) - 1).clamp(min=0)
            full_mask = torch.cat([mask, probe_mask], dim=1)
            with probing(cache.engine, slots, final=r == rounds - 1):
                model(input_ids=ids, attention_mask=full_mask, position_ids=positions, **cache_kwargs(model, cache),
                      use_cache=True, logits_to_keep=1)
    cache.flush()
