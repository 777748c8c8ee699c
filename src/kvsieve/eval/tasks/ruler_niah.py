"""RULER's eight needle-in-a-haystack retrieval tasks (Hsieh et al. 2024, Sec. 3.1), offline.

A needle is ``"One of the special magic {numbers|uuids} for {key} is: {value}."``; the prompt asks for
the values of one or more keys and ends with RULER's answer prefix, so the answer is the continuation::

    Some special magic numbers are hidden within the following text. Make sure to memorize it. I will
    quiz you about the numbers afterwards.
    <haystack with needles>
    What are all the special magic numbers for K mentioned in the provided text? The special magic
    numbers for K mentioned in the provided text are

(singular wording when one value is asked for, as RULER does). Configurations, as in RULER:

=================  ==========  ===========  ==========================================
task               haystack    key / value  needles
=================  ==========  ===========  ==========================================
niah_single_1      noise       word / num   1
niah_single_2      essay       word / num   1
niah_single_3      essay       word / uuid  1
niah_multikey_1    essay       word / num   4 keys (3 distractors), 1 asked
niah_multikey_2    needles     word / num   every haystack line is a needle with another key
niah_multikey_3    needles     uuid / uuid  every haystack line is a needle with another key
niah_multivalue    essay       word / num   1 key with 4 values, all asked
niah_multiquery    essay       word / num   4 keys, all asked
=================  ==========  ===========  ==========================================

"noise" repeats RULER's ``"The grass is green. The sky is blue. ..."`` line, one unit per line; "essay"
is whitespace-collapsed essay text cut at a word count (RULER's unit), needles inserted between
sentences at depths drawn from RULER's 40 depths; "needles" lines are distractor needles. Numbers have
7 digits, keys are two essay words (see :mod:`kvsieve.eval.tasks.text`). Scoring is RULER's
``string_match_all``. ``max_new_tokens`` is sized to the canonical answer plus a margin (RULER's 128 is
for verbose chat models; the prompt here already ends with the answer prefix).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvsieve.eval.tasks.base import Built, SyntheticTask, rng_for
from kvsieve.eval.tasks.text import (
    DEPTHS,
    NOISE,
    distinct,
    haystack_words,
    insert_at_depths,
    join_keys,
    random_key,
    random_number,
    random_uuid,
    split_sentences,
)

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
_INSTRUCTION = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n"
)
_QUESTION = (
    "\nWhat are all the special magic {kind} for {query} mentioned in the provided text? "
    "The special magic {kind} for {query} mentioned in the provided text are"
)


def _singular(template: str, kind: str) -> str:
    """RULER's rewording for a single answer value."""
    text = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
    return text.replace("{kind}", kind[:-1])


@dataclass(frozen=True)
class RulerNiah(SyntheticTask):
    """One RULER NIAH configuration; ``units`` are haystack words (essay) or lines (noise, needles)."""

    name: str
    haystack: str  # "essay" | "noise" | "needles"
    key_type: str = "word"  # "word" | "uuid"
    value_type: str = "number"  # "number" | "uuid"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    max_new_tokens: int = 16

    min_length: int = 256

    def _key(self, rng: random.Random) -> str:
        return random_uuid(rng) if self.key_type == "uuid" else random_key(rng)

    def _value(self, rng: random.Random) -> str:
        return random_uuid(rng) if self.value_type == "uuid" else random_number(rng)

    def build(self, key: str, units: int, length: int) -> Built:
        rng = rng_for(key)
        kind = "uuids" if self.value_type == "uuid" else "numbers"
        keys = distinct(rng, self._key, self.num_keys)
        values = [[self._value(rng) for _ in range(self.num_values)] for _ in keys]
        needles = [NEEDLE.format(kind=kind, key=k, value=v) for k, vs in zip(keys, values, strict=True) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(self.num_keys), self.num_queries)
        depths = sorted(d / 100 for d in rng.sample(DEPTHS, len(needles)))
        context = self._haystack(key, units, needles, depths, keys, kind)
        query = join_keys([keys[i] for i in asked])
        answers = [v for i in asked for v in values[i]]
        single = len(answers) == 1
        instruction = _singular(_INSTRUCTION, kind) if single else _INSTRUCTION.replace("{kind}", kind)
        question = _singular(_QUESTION, kind) if single else _QUESTION.replace("{kind}", kind)
        prompt = instruction + context + question.replace("{query}", query)
        return Built(
            prompt=prompt,
            answer=" " + ", ".join(answers),
            references=answers,
            meta={"keys": keys, "asked": [keys[i] for i in asked], "depths": depths, "haystack_units": units},
        )

    def _haystack(
        self, key: str, units: int, needles: list[str], depths: list[float], keys: list[str], kind: str
    ) -> str:
        if self.haystack == "essay":
            sentences = split_sentences(" ".join(haystack_words(key, units, rng_for(key, "essay"))))
            return " ".join(insert_at_depths(sentences, needles, depths))
        if self.haystack == "noise":
            return "\n".join(insert_at_depths([NOISE] * units, needles, depths))
        stream = rng_for(key, "distractors")  # line i never depends on the line count
        seen, lines = set(keys), []
        while len(lines) < units:
            other = self._key(stream)
            if other not in seen:
                seen.add(other)
                lines.append(NEEDLE.format(kind=kind, key=other, value=self._value(stream)))
        return "\n".join(insert_at_depths(lines, needles, depths))


NIAH_TASKS: tuple[RulerNiah, ...] = (
    RulerNiah("niah_single_1", "noise"),
    RulerNiah("niah_single_2", "essay"),
    RulerNiah("niah_single_3", "essay", value_type="uuid", max_new_tokens=48),
    RulerNiah("niah_multikey_1", "essay", num_keys=4),
    RulerNiah("niah_multikey_2", "needles"),
    # UUID needle lines are ~76 tokens: too coarse for ±3% below 512 tokens.
    RulerNiah("niah_multikey_3", "needles", key_type="uuid", value_type="uuid", max_new_tokens=48, min_length=512),
    RulerNiah("niah_multivalue", "essay", num_values=4, max_new_tokens=48),
    RulerNiah("niah_multiquery", "essay", num_keys=4, num_queries=4, max_new_tokens=48),
)
