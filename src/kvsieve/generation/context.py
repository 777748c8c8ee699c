"""Compress once, ask many: one compressed context answering several questions (one by one or in a batch).

:func:`compress_context` runs the context through the model once with a cache built from ``policy``
and ``budget`` (the context alone: no question is known yet, so the compression is question-agnostic,
as in kvpress's pipeline). :meth:`CompressedContext.ask` and :meth:`CompressedContext.ask_batch` then
start every question from a deep copy of that compressed cache, so the context is never recompressed
and no question's tokens or evictions reach the next question.

The question's own forward follows the policy's schedule: under the ``prefill`` schedule a multi-token
forward is compressed back to the budget, so the question (now the observation window) may evict
further context entries of *its copy*; the stored context is untouched.

Batches left-pad each question *after* the context and pass explicit position ids, so every row sees
the positions its question would have alone; pads are masked and never stored by a ``KVCache``.
Decoding is greedy.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Cache, DynamicCache

from kvsieve.attention.backends import cudnn_attention_off
from kvsieve.engine.kv_cache import KVCache
from kvsieve.generation.prompt import PromptFormat, prompt_format
from kvsieve.generation.reconstruction import reads_reconstruction, reconstruct
from kvsieve.generation.saved_context import FULL, load_saved, save_context
from kvsieve.models.architectures import model_info
from kvsieve.policies.presets import make_policy
from kvsieve.transformers_adapter import cache_kwargs


@dataclass(frozen=True)
class ContextStats:
    """What the compressed context holds, against the full cache of the same tokens."""

    policy: str
    context_tokens: int
    entries_held: int
    entries_full: int
    kv_bytes: int
    kv_bytes_full: int
    prefill_s: float

    @property
    def kv_mib(self) -> float:
        return self.kv_bytes / 2**20

    @property
    def kv_fraction(self) -> float:
        """Bytes held / bytes of the full cache (1.0 for the full cache)."""
        return self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else 1.0


@dataclass(frozen=True)
class Answer:
    """One question's greedy answer, the log-probability of each generated token, and the timings."""

    question: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    question_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        """Decoding throughput after the question's forward (generated tokens after the first / seconds)."""
        steps = max(0, len(self.token_ids) - 1)
        return steps / self.decode_s if self.decode_s > 0 and steps else float("nan")


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _full_entry_bytes(model: Any) -> int:
    """Bytes one token takes in an uncompressed cache: 2 × layers × KV heads × head_dim × element size."""
    info = model_info(model)
    element = torch.finfo(next(model.parameters()).dtype).bits // 8
    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * element


def _held(model: Any, cache: Cache, tokens: int) -> tuple[int, int, int]:
    """(entries held, kv bytes held, entries of the full cache) of a one-row cache after the context."""
    info = model_info(model)
    full_entries = tokens * info.num_layers * info.num_kv_heads
    if isinstance(cache, KVCache):
        return int(cache.head_lengths().sum()), cache.kv_nbytes(), full_entries
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    entries = sum(int(layer.keys.shape[1] * layer.keys.shape[2]) for layer in layers)
    return entries, sum(layer.keys.nbytes + layer.values.nbytes for layer in layers), full_entries


class CompressedContext:
    """A context prefilled (and compressed) once; see the module docstring. Build with :func:`compress_context`."""

    def __init__(self, model: Any, tokenizer: Any, cache: Cache, fmt: PromptFormat, stats: ContextStats) -> None:
        self.model, self.tokenizer, self.format, self.stats = model, tokenizer, fmt, stats
        self._cache = cache
        #: ``{"name", "budget", "params"}`` of a preset-built cache (what :meth:`save` records); None otherwise.
        self.policy_spec: dict[str, Any] | None = None
        self._eos = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self._eos), 0)
        self._pad = int(pad)

    @property
    def cache(self) -> Cache:
        """The compressed context's cache (read it; every question works on a copy)."""
        return self._cache

    def _question_ids(self, question: str) -> list[int]:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question: expected a non-empty string; got {question!r}")
        ids = list(self.tokenizer(self.format.question_text(question), add_special_tokens=False).input_ids)
        return ids

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Save to ``<path>.safetensors`` + ``<path>.json``; :func:`kvsieve.load_context` reads them back in
        any process, with the same model (checked by fingerprint) — see :mod:`kvsieve.generation.saved_context`."""
        return save_context(path, self.model, self.cache, self.policy_spec, self.format, self.stats.__dict__)

    def ask(self, question: str, max_new_tokens: int = 64, streamer: Any = None) -> Answer:
        """Answer one question from a copy of the compressed context (greedy; ``streamer`` gets each token:
        a ``transformers.TextStreamer`` prints the answer as it is generated)."""
        return self._run([question], max_new_tokens, streamer)[0]

    def ask_batch(self, questions: Sequence[str], max_new_tokens: int = 64) -> list[Answer]:
        """Answer every question in one batch; row ``i`` starts from its own copy of the compressed context."""
        if isinstance(questions, str) or not questions:
            raise ValueError("questions: expected a non-empty list of strings")
        return self._run(list(questions), max_new_tokens, None)

    def _run(self, questions: list[str], max_new_tokens: int, streamer: Any) -> list[Answer]:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an integer ≥ 1; got {max_new_tokens!r}")
        encoded = [self._question_ids(q) for q in questions]
        rows, width = len(encoded), max(len(ids) for ids in encoded)
        device = self.model.device
        seen = self.stats.context_tokens
        ids = torch.full((rows, width), self._pad, dtype=torch.long, device=device)
        qmask = torch.zeros((rows, width), dtype=torch.long, device=device)
        for row, q in enumerate(encoded):
            ids[row, width - len(q):] = torch.tensor(q, device=device)
            qmask[row, width - len(q):] = 1
        mask = torch.cat([torch.ones((rows, seen), dtype=torch.long, device=device), qmask], dim=1)
        positions = seen + (qmask.cumsum(1) - 1).clamp(min=0)  # each row: its question right after the context
        cache = copy.deepcopy(self._cache)
        if rows > 1:
            cache.batch_repeat_interleave(rows)
        generated: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        with torch.inference_mode(), cudnn_attention_off(device):  # a DynamicCache as kvsieve's caches attend
            started = time.perf_counter()
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                logits_to_keep=1, **cache_kwargs(self.model, cache)).logits[:, -1]
            token = logits.argmax(-1)
            question_s = time.perf_counter() - started
            started = time.perf_counter()
            next_pos = positions[:, -1:] + 1
            for step in range(max_new_tokens):
                chosen = logits.float().log_softmax(-1).gather(1, token[:, None])[:, 0]
                values, scores = token.tolist(), chosen.tolist()  # one host transfer per step: tokens are output
                for row, value in enumerate(values):
                    if not done[row]:
                        generated[row].append(value)
                        logprobs[row].append(scores[row])
                if streamer is not None:
                    streamer.put(token[:1].cpu())
                done |= torch.tensor([v in self._eos for v in values], device=device)
                if bool(done.all()) or step == max_new_tokens - 1:
                    break
                mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long, device=device)], dim=1)
                logits = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos,
                                    **cache_kwargs(self.model, cache), use_cache=True).logits[:, -1]
                token = logits.argmax(-1)
                next_pos = next_pos + 1
            decode_s = time.perf_counter() - started
        if streamer is not None:
            streamer.end()
        del cache
        answers = []
        for question, tokens, scores in zip(questions, generated, logprobs, strict=True):
            text_ids = [t for t in tokens if t not in self._eos]
            answers.append(Answer(question, self.tokenizer.decode(text_ids, skip_special_tokens=True).strip(),
                                  tokens, scores, question_s, decode_s))
        return answers


def _make_cache(model: Any, policy: str | Any, budget: int | None, params: dict[str, Any]) -> tuple[Cache, str]:
    if policy is None or policy == FULL:
        if params:
            raise ValueError(f"policy 'full' takes no parameters; got {sorted(params)}")
        return DynamicCache(config=model.config), FULL
    if isinstance(policy, str):
        built = make_policy(policy, budget=budget, **params)
        return KVCache(model, built), policy
    return KVCache(model, policy, **params), str(getattr(policy, "name", type(policy).__name__))


def compress_context(
    model: Any,
    tokenizer: Any,
    context: str,
    policy: str | Any = "snapkv",
    budget: int | None = 256,
    *,
    chat: bool | None = None,
    **params: Any,
) -> CompressedContext:
    """Prefill ``context`` once into a cache of ``policy`` (``"full"`` for no compression) and compress it.

    Args:
        model, tokenizer: a supported causal LM and its tokenizer (e.g. from :func:`kvsieve.load_model`).
        context: the document; questions come after it.
        policy: a preset name (``kvsieve list``), a :class:`kvsieve.Policy`, or ``"full"``.
        budget: entries per KV head kept (ignored by ``"full"`` and by ``Policy`` objects).
        chat: wrap context and question in the tokenizer's chat template (default: when it has one).
        params: further policy parameters (``window=16``, ``schedule="blockwise"``...).

    Raises:
        ValueError: an empty context, an unknown policy or a bad parameter (before any forward pass).
    """
    if not isinstance(context, str) or not context.strip():
        raise ValueError("context: expected a non-empty string")
    cache, name = _make_cache(model, policy, budget, dict(params))
    fmt = prompt_format(tokenizer, context, chat)
    ids = torch.tensor([fmt.context_ids], dtype=torch.long, device=model.device)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] >= limit:
        raise ValueError(f"context: {ids.shape[1]} tokens do not fit the model's {limit} positions")
    with torch.inference_mode(), cudnn_attention_off(ids.device):  # a DynamicCache as kvsieve's caches attend
        started = time.perf_counter()
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        if reads_reconstruction(cache):  # KVzip: score by repeating the context, then compress (in prefill_s)
            reconstruct(model, tokenizer, cache, ids)
        if isinstance(cache, KVCache):
            cache.flush()  # the compaction belongs to the prefill
        prefill_s = time.perf_counter() - started
    held, nbytes, full_entries = _held(model, cache, ids.shape[1])
    full_bytes = ids.shape[1] * _full_entry_bytes(model)
    stats = ContextStats(name, int(ids.shape[1]), held, full_entries, nbytes, full_bytes, prefill_s)
    context = CompressedContext(model, tokenizer, cache, fmt, stats)
    if policy is None or isinstance(policy, str):
        context.policy_spec = {"name": name, "budget": None if name == FULL else budget, "params": dict(params)}
    return context


def load_context(stem: str | Path, model: Any, tokenizer: Any) -> CompressedContext:
    """A context saved by :meth:`CompressedContext.save`, on ``model`` (the same weights and dtype, checked by
    fingerprint before anything is built) — see :mod:`kvsieve.generation.saved_context`."""
    cache, fmt, stats, spec = load_saved(stem, model)
    context = CompressedContext(model, tokenizer, cache, fmt, ContextStats(**stats))
    context.policy_spec = spec
    return context
