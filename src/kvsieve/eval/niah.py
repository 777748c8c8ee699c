"""Passkey retrieval in Paul Graham's essays ("needle in a haystack").

A sample is a plain completion prompt (no chat template: this retrieves far better on small
instruct models such as SmolLM2-135M-Instruct)::

    There is an important piece of information hidden inside a lot of irrelevant text. Find it and
    memorize it. I will quiz you about the important information there.

    <essay text ... The pass key is 68231. Remember it. 68231 is the pass key. ... essay text>

    What is the pass key? The pass key is

and the answer is its continuation, `` 68231``. The needle sits at a sentence boundary at relative
``depth`` of the essay text (0.0 = start, 1.0 = end); the pass key and the essay the text starts at
are drawn from ``seed``.

:func:`score_sample` greedy-decodes and teacher-forces the answer with plain forward calls on
whatever cache ``make_cache`` builds, so the same code scores a full cache and any compressed one.
"""

from __future__ import annotations

import bisect
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.eval.haystack import load_essay_texts

PREFIX = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
SUFFIX = "\n\nWhat is the pass key? The pass key is"

_GLUED_PARAGRAPH = re.compile(r"([a-z][.!?][\"')]?)([A-Z][a-z])")  # "slow.We" -> paragraph break
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?:\[\d+\])?(?=\s)")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class NeedleSample:
    """One passkey-retrieval prompt and its expected answer.

    ``needle_start``/``needle_end`` delimit (end exclusive) the prompt tokens that overlap the
    needle sentence; ``decode`` turns generated ids back into text (the tokenizer's ``decode``).
    """

    prompt_ids: list[int]
    answer: str
    answer_ids: list[int]
    context_tokens: int
    depth: float
    seed: int
    needle_start: int
    needle_end: int
    prompt: str = field(repr=False)
    decode: Callable[[Sequence[int]], str] = field(repr=False, compare=False)

    @property
    def prompt_tokens(self) -> int:
        """Actual prompt length in tokens (within 2% of ``context_tokens``)."""
        return len(self.prompt_ids)


@lru_cache(maxsize=8)
def _haystack_source(start: int) -> str:
    """Essays from index ``start`` on (wrapping round), cleaned: paragraphs restored, lines unwrapped."""
    essays = load_essay_texts()
    text = "\n\n".join(essays[start:] + essays[:start])
    text = _GLUED_PARAGRAPH.sub(r"\1\n\n\2", text)
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


def _insert(text: str, at: int, needle: str) -> tuple[str, int]:
    """``text`` with ``needle`` inserted at char ``at`` (a sentence boundary); also the needle's char offset."""
    if at <= 0:
        return f"{needle} {text}", 0
    if at >= len(text):
        return f"{text} {needle}", len(text) + 1
    return f"{text[:at]} {needle}{text[at:]}", at + 1


def _closest(positions: Sequence[int], counts: Sequence[int], goal: float) -> int:
    """The position whose token count is closest to ``goal`` (first one on ties)."""
    best = min(range(len positions) if False else range(len(positions)), key=lambda i: abs(counts[i] - goal))
    return positions[best]
