"""The needle-in-a-haystack grid (length × depth) on :func:`kvsieve.eval.niah.make_passkey_sample`.

Sample ``index`` puts the pass key at depth ``DEPTHS[index % len(DEPTHS)]`` of a prompt of ``length``
tokens (±2%, the passkey builder's own tolerance), so ``num_samples = 5`` covers the five depths once
and more samples repeat them with other pass keys and essays. Scored by exact match of the first
number generated (as ``kvsieve niah``); the record carries ``depth``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import ClassVar

from transformers import PreTrainedTokenizerBase

from kvsieve.eval.niah import make_passkey_sample
from kvsieve.eval.tasks.base import Task, TaskSample, sample_key

_WHOLE_NUMBER = re.compile(r"\d\D")
DEPTHS: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class PasskeyGrid(Task):
    """Passkey retrieval at the five depths of ``kvsieve niah``."""

    name: str = "passkey"
    depths: tuple[float, ...] = DEPTHS
    max_new_tokens: int = 8

    metric: ClassVar[str] = "first_number"
    min_length: int = 128

    def make_sample(self, tokenizer: PreTrainedTokenizerBase, length: int, index: int, seed: int) -> TaskSample:
        self.check_length(length)
        depth = self.depths[index % len(self.depths)]
        digest = hashlib.sha256(sample_key(self.name, length, seed, index).encode()).digest()
        passkey_seed = int.from_bytes(digest[:4], "big")
        sample = make_passkey_sample(tokenizer, length, depth, passkey_seed)
        return TaskSample(
            task=self.name,
            index=index,
            seed=seed,
            prompt_ids=list(sample.prompt_ids),
            references=[sample.answer],
            answer_ids=list(sample.answer_ids),
            context_tokens=length,
            meta={
                "depth": depth,
                "needle_start": sample.needle_start,
                "needle_end": sample.needle_end,
                "passkey_seed": passkey_seed,
            },
            prompt=sample.prompt,
            answer=sample.answer,
        )

    def done(self, sample: TaskSample, generated_text: str) -> bool:
        """Stop once a whole number has been generated (a digit run followed by anything else)."""
        return _WHOLE_NUMBER.search(generated_text) is not None
