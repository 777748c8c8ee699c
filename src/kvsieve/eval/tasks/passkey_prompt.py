"""Passkey retrieval in Paul Graham's essays ("needle in a haystack").

A sample is a plain completion prompt (no chat template: plain completion retrieves better on small
instruct models such as SmolLM2-135M-Instruct)::

    There is an important piece of information hidden inside a lot of irrelevant text. Find it and
    memorize it. I will quiz you about the pass key.

    <essay text ... The pass key is 68231. Remember it. 68231 is the pass key. ... essay text>

    What is the pass key? The pass key is ␣

ending in a space (shown as ␣) where the tokenizer gives the space before a number a token of its
own, as SmolLM2's does; the answer is then the bare digits ``68231`` (one token per digit). With
other tokenizers the prompt ends at "is" and the answer is `` 68231``. The needle sits at a sentence
boundary at relative ``depth`` of the essay text (0.0 = start, 1.0 = end); the pass key and the
essay the text starts at are drawn from ``seed``.

Naming "the pass key" in the instruction matters: with the classic "...quiz you about the important
information there." SmolLM2-135M picked up other numbers of a number-heavy essay (3 misses in 27
samples at 2k-4k); naming it fixed those and raised the answer log-probs.

Both passkey tasks build their prompts here: ``niah`` (:class:`kvsieve.eval.tasks.passkey.NiahGrid`, the
``kvsieve niah`` grid) and the sweep's ``passkey`` (:class:`kvsieve.eval.tasks.passkey.PasskeyGrid`).
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from kvsieve.models.haystack import load_essay_texts

PREFIX = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key.\n\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
SUFFIX = "\n\nWhat is the pass key? The pass key is"

# Paragraph breaks lost in the files: "slow.We", "better.A super", "good.[2]So", "2010What".
_GLUED_PARAGRAPH = re.compile(r"([a-z][.!?][\"')]?|[.!?]\[\d+\]|\b(?:19|20)\d\d)([A-Z](?:[a-z]|\s))")
_CP1252 = str.maketrans({"\x97": "—", "\x96": "–", "\x92": "'", "\x93": '"', "\x94": '"', "\xa0": " "})
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?:\[\d+\])?(?=\s)")


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
    text = "\n\n".join(essays[start:] + essays[:start]).translate(_CP1252)
    text = _GLUED_PARAGRAPH.sub(r"\1\n\n\2", text)
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


def _insert(text: str, at: int, needle: str) -> tuple[str, int]:
    """``text`` with ``needle`` inserted at char ``at`` (a sentence boundary), and the needle's offset."""
    if at <= 0:
        return f"{needle} {text}", 0
    if at >= len(text):
        return f"{text} {needle}", len(text) + 1
    return f"{text[:at]} {needle}{text[at:]}", at + 1


def _closest(positions: Sequence[int], counts: Sequence[int], goal: float) -> int:
    """The position whose token count is closest to ``goal`` (the first one on ties)."""
    best = min(range(len(positions)), key=lambda i: abs(counts[i] - goal))
    return positions[best]


def _token_span(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Indices (end exclusive) of the tokens overlapping chars ``[start, end)``."""
    hits = [i for i, (s, e) in enumerate(offsets) if e > s and e > start and s < end]
    return hits[0], hits[-1] + 1


def _split_suffix(tokenizer: PreTrainedTokenizerBase, key: str) -> tuple[str, str]:
    """The prompt's ending and the answer's text, with the space before the digits placed so that
    ``prompt + answer`` tokenizes as ``prompt_ids + answer_ids``.

    Where the space before a number is a token of its own (SmolLM2: ``"is 68231"`` is
    ``Ġis Ġ 6 8 2 3 1``, in the needle as in the answer), the space ends the prompt and the answer is
    the bare digits: the model then continues straight into the number, instead of spreading its
    first step over " a", " the", " " (measured: log-prob of " " alone -2 to -4 at 2k-4k tokens).
    Otherwise (tokenizers that merge "▁6") the answer keeps its leading space.
    """
    spaced = tokenizer(SUFFIX + " ", add_special_tokens=False).input_ids
    full = tokenizer(f"{SUFFIX} {key}", add_special_tokens=False).input_ids
    if full[: len(spaced)] == spaced and len(full) > len(spaced):
        return SUFFIX + " ", key
    return SUFFIX, " " + key


def _answer_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, prompt_ids: list[int], answer: str) -> list[int]:
    """Tokens of ``answer`` as they continue ``prompt`` (what greedy decoding would emit)."""
    full = tokenizer(prompt + answer).input_ids
    if full[: len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
        return list(full[len(prompt_ids) :])
    return list(tokenizer(answer, add_special_tokens=False).input_ids)


def make_passkey_sample(
    tokenizer: PreTrainedTokenizerBase, context_tokens: int, depth: float, seed: int
) -> NeedleSample:
    """Build a passkey prompt of ``context_tokens`` tokens (±2%) with the needle at relative ``depth``.

    The prompt is tokenized with the tokenizer's own special tokens (none for SmolLM2). The pass key
    is five digits and the essays start at an essay chosen by ``seed``; both are deterministic.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = str(rng.randint(10_000, 99_999))
    needle = NEEDLE.format(key=key)
    source = _haystack_source(rng.randrange(len(load_essay_texts())))
    window = source
    while len(window) < 8 * context_tokens:
        window = f"{window}\n\n{source}"
    window = window[: 8 * context_tokens]
    window_enc = tokenizer(window, add_special_tokens=False, return_offsets_mapping=True)
    ends = [e for _, e in window_enc["offset_mapping"]]
    boundaries = [m.end() for m in _SENTENCE_END.finditer(window)]
    suffix, answer_text = _split_suffix(tokenizer, key)
    overhead = len(tokenizer(PREFIX + suffix).input_ids)
    overhead += len(tokenizer(" " + needle, add_special_tokens=False).input_ids)
    budget = context_tokens - overhead
    if budget < 16:
        raise ValueError(
            f"context_tokens={context_tokens} is too short: a passkey prompt needs at least {overhead + 16}"
        )
    tolerance = max(1, int(0.015 * context_tokens))  # leaves slack under the promised 2%
    best: tuple[int, str, list[int], list[tuple[int, int]], int] | None = None
    for attempt in range(6):
        if not 0 < budget <= len(ends):
            raise RuntimeError(f"could not fit a {context_tokens}-token passkey prompt (text budget {budget})")
        cut = ends[budget - 1]
        near = boundaries[max(0, bisect.bisect_right(boundaries, cut) - 1) :][:2]
        near_counts = [bisect.bisect_right(ends, b) for b in near]
        if attempt < 3 and near and min(abs(c - budget) for c in near_counts) <= tolerance:
            cut = _closest(near, near_counts, budget)  # end on a whole sentence if cheap (and it converges)
        haystack = window[:cut].rstrip()
        inner = [0, *(b for b in boundaries if b < len(haystack)), len(haystack)]
        counts = [bisect.bisect_right(ends, b) for b in inner]
        text, offset = _insert(haystack, _closest(inner, counts, depth * counts[-1]), needle)
        prompt = PREFIX + text + suffix
        encoded = tokenizer(prompt, return_offsets_mapping=True)
        ids = list(encoded.input_ids)
        miss = len(ids) - context_tokens
        if best is None or abs(miss) < abs(best[0]):
            best = (miss, prompt, ids, list(encoded["offset_mapping"]), len(PREFIX) + offset)
        if abs(miss) <= tolerance:
            break
        budget -= miss
    assert best is not None
    miss, prompt, ids, offsets, needle_char = best
    if abs(miss) > max(1, int(0.02 * context_tokens)):
        raise RuntimeError(f"could not build a {context_tokens}-token prompt (off by {miss} tokens)")
    start, end = _token_span(offsets, needle_char, needle_char + len(needle))
    return NeedleSample(
        prompt_ids=ids,
        answer=key,
        answer_ids=_answer_ids(tokenizer, prompt, ids, answer_text),
        context_tokens=context_tokens,
        depth=depth,
        seed=seed,
        needle_start=start,
        needle_end=end,
        prompt=prompt,
        decode=tokenizer.decode,
    )
