"""RULER's aggregation tasks (Hsieh et al. 2024, Sec. 3.3), offline: ``cwe`` and ``fwe``.

``cwe`` (common words extraction): a numbered list ``1. word 2. word ...`` in which 10 words appear
often and the others rarely (RULER: below 4096 tokens 6 times vs once, with a solved example of 20
words repeated 3 vs 1 times; from 4096 tokens 30 vs 3 times, example of 40 words 10 vs 3); the answer
is the 10 frequent words. ``units`` are distinct words; words come from the essay vocabulary
(:func:`kvsieve.eval.tasks.text.vocabulary`) instead of ``wonderwords``.

``fwe`` (frequent words extraction): random 6-letter "coded words" whose counts follow a Zipf law
(α = 2, a vocabulary of ``length // 50`` words); the most frequent is replaced by ``"..."`` (noise)
and the answer is the next three. ``units`` is the Zipf total ``N`` (word ``k`` appears
``⌊N k^-α / ζ(α)⌋`` times).

Both end with RULER's answer prefix and use ``string_match_all``. ``max_new_tokens``: 64 for cwe (its
canonical answer ``1. w 2. w ...`` is ~50 tokens; RULER allows 120) and 32 for fwe (RULER: 50).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from kvsieve.eval.tasks.base import Built, SyntheticTask, rng_for
from kvsieve.eval.tasks.text import random_letters, vocabulary

_CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list? "
    "Answer: The top 10 words that appear most often in the list are:"
)
_FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text? Answer: According to the coded "
    "text above, the three most frequently appeared words are:"
)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


@dataclass(frozen=True)
class CommonWords(SyntheticTask):
    """RULER ``cwe``; ``units`` are distinct words in the question's list (≥ ``num_common``)."""

    name: str = "cwe"
    num_common: int = 10
    max_new_tokens: int = 64

    min_length: int = 1024
    min_units: ClassVar[int] = 10

    def _repeats(self, length: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """(example words, example common, example rare), (common, rare) repeats, as RULER."""
        return ((20, 3, 1), (6, 1)) if length < 4096 else ((40, 10, 3), (30, 3))

    def build(self, key: str, units: int, length: int) -> Built:
        words = list(vocabulary())
        rng_for(key).shuffle(words)
        (ex_count, ex_common, ex_rare), (common_rep, rare_rep) = self._repeats(length)
        if units + ex_count > len(words):
            raise ValueError(f"cwe: {units} words requested but the vocabulary has {len(words) - ex_count}")
        example_words = words[-ex_count:]
        ex_list = example_words[: self.num_common] * ex_common + example_words[self.num_common :] * ex_rare
        rng_for(key, "example-order").shuffle(ex_list)
        chosen = words[:units]
        common = chosen[: self.num_common]
        listing = common * common_rep + chosen[self.num_common :] * rare_rep
        rng_for(key, "order").shuffle(listing)
        example = _CWE_TEMPLATE.format(context=_numbered(ex_list)) + " " + _numbered(example_words[: self.num_common])
        return Built(
            prompt=example + "\n" + _CWE_TEMPLATE.format(context=_numbered(listing)),
            answer=" " + _numbered(common),
            references=common,
            meta={"distinct_words": units, "list_length": len(listing)},
        )


@lru_cache(maxsize=8)
def _zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann ζ(α) for α > 1: a partial sum plus the integral tail."""
    return sum(k**-alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1)


@dataclass(frozen=True)
class FrequentWords(SyntheticTask):
    """RULER ``fwe``; ``units`` is the Zipf total ``N``."""

    name: str = "fwe"
    alpha: float = 2.0
    word_length: int = 6
    max_new_tokens: int = 32

    min_length: int = 256
    min_units: ClassVar[int] = 64

    def build(self, key: str, units: int, length: int) -> Built:
        rng = rng_for(key)
        size = max(8, length // 50)
        vocab: set[str] = set()
        while len(vocab) < size:
            vocab.add(random_letters(rng, self.word_length))
        coded = sorted(vocab)
        rng.shuffle(coded)
        coded[0] = "..."  # the most frequent "word" is noise
        zeta = _zeta(self.alpha)
        counts = [int(units * k**-self.alpha / zeta) for k in range(1, size + 1)]
        text = [word for word, count in zip(coded, counts, strict=True) for _ in range(count)]
        rng_for(key, "order").shuffle(text)
        answer = coded[1:4]
        return Built(
            prompt=_FWE_TEMPLATE.format(context=" ".join(text)),
            answer=" " + " ".join(answer),
            references=answer,
            meta={"zipf_total": units, "counts": counts[:5], "vocab_size": size},
        )
