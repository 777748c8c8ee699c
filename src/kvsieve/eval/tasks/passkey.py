"""The two passkey grids on :func:`kvsieve.eval.tasks.passkey_prompt.make_passkey_sample`.

:class:`PasskeyGrid` (``passkey``, a ``generate`` task of the eval sweep): sample ``index`` puts the
pass key at depth ``DEPTHS[index % len(DEPTHS)]`` of a prompt of ``length``
tokens (±2%, the passkey builder's own tolerance), so ``num_samples = 5`` covers the five depths once
and more samples repeat them with other pass keys and essays. Scored by exact match of the first
number generated (as ``kvsieve niah``); the record carries ``depth``.

:class:`NiahGrid` (``niah``, the ``needle`` cell kind of ``kvsieve niah``): the caller's depths, and the
pass key drawn from the seed itself, so the grid ``length × depth × seed`` of ``kvsieve niah`` is
sample ``depth index`` at seed ``seed``; scored as :mod:`kvsieve.eval.cells.needle` says.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import ClassVar

from transformers import PreTrainedTokenizerBase

from kvsieve.eval.tasks.base import Task, TaskSample, sample_key
from kvsieve.eval.tasks.passkey_prompt import NeedleSample, make_passkey_sample

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
        return _needle_sample(self.name, index, seed, sample, passkey_seed=passkey_seed)

    def done(self, sample: TaskSample, generated_text: str) -> bool:
        """Stop once a whole number has been generated (a digit run followed by anything else)."""
        return _WHOLE_NUMBER.search(generated_text) is not None


def _needle_sample(name: str, index: int, seed: int, sample: NeedleSample, **extra: object) -> TaskSample:
    """A :class:`TaskSample` of a passkey prompt; ``meta``: depth, the needle's token span, then ``extra``."""
    return TaskSample(
        task=name,
        index=index,
        seed=seed,
        prompt_ids=list(sample.prompt_ids),
        references=[sample.answer],
        answer_ids=list(sample.answer_ids),
        context_tokens=sample.context_tokens,
        meta={"depth": sample.depth, "needle_start": sample.needle_start, "needle_end": sample.needle_end, **extra},
        prompt=sample.prompt,
        answer=sample.answer,
    )


@dataclass(frozen=True)
class NiahGrid(Task):
    """The ``kvsieve niah`` grid: sample ``index`` at ``seed`` is the pass key at depth
    ``depths[index % len(depths)]`` drawn with seed ``seed + index // len(depths)``."""

    name: str = "niah"
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    max_new_tokens: int = 8

    kind: ClassVar[str] = "needle"
    metric: ClassVar[str] = "first_number"
    min_length: int = 128

    def make_sample(self, tokenizer: PreTrainedTokenizerBase, length: int, index: int, seed: int) -> TaskSample:
        self.check_length(length)
        depth = self.depths[index % len(self.depths)]
        sample = make_passkey_sample(tokenizer, length, depth, seed + index // len(self.depths))
        return _needle_sample(self.name, index, seed, sample)
