"""What a cell runner gets: :class:`CellContext` (one task sample under one cache) and the helpers every
kind shares (the prefill, possibly done already by a shared forward, and the answer-span comparison)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Cache

from kvsieve.eval.metrics import answer_logprob, mean_kl
from kvsieve.eval.passes import forward_logits
from kvsieve.eval.reference import fingerprint, load_reference, reference_path, save_reference
from kvsieve.eval.tasks import Task, TaskSample
from kvsieve.generation.reconstruction import reads_reconstruction, reconstruct
from kvsieve.models.architectures import model_info

#: A cache filled by a shared prefill: ``(cache, last-position logits (vocab,), seconds, caches sharing it)``.
Prefilled = tuple[Cache, torch.Tensor, float, int]


@dataclass
class CellContext:
    """One task sample under one cache: what a cell runner (one per task kind) reads.

    ``make_cache`` builds a fresh cache of the cell's policy; ``stepwise`` says whether teacher forcing
    must go one token per forward (:func:`kvsieve.eval.passes.needs_stepwise`); ``memory`` holds the
    references of this sample already computed in this process, by fingerprint extra.
    """

    model: torch.nn.Module
    tokenizer: Any
    task: Task
    sample: TaskSample
    make_cache: Callable[[], Cache]
    is_full: bool
    stepwise: bool
    budget: int | None
    reference_dir: Path | None
    prefilled: Prefilled | None = None
    memory: dict[str, dict[str, torch.Tensor]] | None = None

    def decode(self, ids: list[int]) -> str:
        """Generated ids as text, special tokens dropped."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def load(self, extra: str = "") -> dict[str, torch.Tensor] | None:
        """The full cache's reference of this sample (memory first, then ``reference_dir``), or None."""
        if self.memory is not None and extra in self.memory:
            return self.memory[extra]
        if self.reference_dir is None:
            return None
        path = reference_path(self.reference_dir, self.sample)
        return load_reference(path, fingerprint(self.model, self.sample, extra))

    def save(self, tensors: dict[str, torch.Tensor], extra: str = "") -> None:
        """Keep the reference in memory and, with a ``reference_dir``, on disk for later cells."""
        if self.memory is not None:
            self.memory[extra] = tensors
        if self.reference_dir is not None:
            path = reference_path(self.reference_dir, self.sample)
            save_reference(path, tensors, fingerprint(self.model, self.sample, extra))

    def full_kv_bytes(self, tokens: int) -> int:
        """Keys and values a full cache holds after ``tokens`` tokens (sliding layers: their window)."""
        info = model_info(self.model)
        element = torch.empty((), dtype=next(self.model.parameters()).dtype).element_size()
        per_token = info.num_kv_heads * info.head_dim * 2 * element
        held = sum(tokens if w is None else min(tokens, w - 1) for w in info.sliding_windows)
        return int(held * per_token)


def prefill(cell: CellContext) -> tuple[Any, torch.Tensor, float]:
    """The cell's cache holding the prompt, the last position's logits ``(vocab,)`` and the prefill seconds.

    A cache filled by the shared forward is taken as it is (its seconds: the whole shared forward's). A cache
    scored by reconstruction (KVzip) repeats the prompt after it and is compressed before this returns; its
    seconds include the reconstruction.
    """
    if cell.prefilled is not None:
        cache, first, seconds, _ = cell.prefilled
        return cache, first, seconds
    cache = cell.make_cache()
    started = time.perf_counter()
    first = forward_logits(cell.model, cell.sample.prompt_ids, cache, 1)[-1]
    if reads_reconstruction(cache):  # KVzip: the prompt is scored by repeating it, then compressed (timed)
        ids = torch.tensor([cell.sample.prompt_ids], dtype=torch.long, device=first.device)
        reconstruct(cell.model, cell.tokenizer, cache, ids)
    return cache, first, time.perf_counter() - started


def answer_fields(rows: torch.Tensor, ref: dict[str, torch.Tensor], answer: list[int]) -> dict[str, Any]:
    """Answer log-likelihood against the full cache's, their gap, KL(full ‖ this cache) and argmax match."""
    own = answer_logprob(rows, answer)
    full = float(ref["answer_logprobs"].double().sum())
    return {
        "answer_logprob": own,
        "answer_logprob_full": full,
        "logprob_gap": full - own,
        "kl_full_compressed": mean_kl(ref["rows"], rows),
        "argmax_match": bool((rows.argmax(-1).cpu() == torch.tensor(answer)).all()),
    }
