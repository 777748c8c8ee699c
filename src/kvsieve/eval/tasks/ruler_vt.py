"""RULER's variable tracking (``vt``, multi-hop tracing; Hsieh et al. 2024, Sec. 3.2), offline.

A chain ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... (1 chain, 4 hops, 5-letter names, as
RULER's defaults) is scattered over lines of RULER's repeated noise; the question asks for every
variable assigned the value, and the prompt ends with RULER's answer prefix::

    Memorize and track the chain(s) of variable assignment hidden in the following text.

    <noise lines with the chain>
    Question: Find all variables that are assigned the value 12345 in the text above. Answer: According
    to the chain(s) of variable assignment in the text above, 5 variables are assigned the value 12345,
    they are:

Like RULER, one solved example (3-letter names, a shorter noise context of :data:`EXAMPLE_LINES`
lines; RULER builds its example at 500 tokens) comes first. ``units`` are noise lines. Scoring:
``string_match_all`` over the variable names; ``max_new_tokens`` 30 as in RULER. (RULER's template
spells "assgined"; the typo is fixed here.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvsieve.eval.tasks.base import Built, SyntheticTask, rng_for
from kvsieve.eval.tasks.text import NOISE, random_letters

EXAMPLE_LINES = 4
_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {value} in the text above. Answer: According to "
    "the chain(s) of variable assignment in the text above, {count} variables are assigned the value {value}, "
    "they are:"
)


def _chain(rng: random.Random, hops: int, letters: int) -> tuple[list[str], str, list[str]]:
    """Variable names, the value, and the statements ``VAR X0 = value``, ``VAR X1 = VAR X0``..."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = random_letters(rng, letters, upper=True)
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, value, statements


def _context(rng: random.Random, lines: int, statements: list[str]) -> str:
    """Noise lines with the statements inserted in order at random line positions (RULER's layout)."""
    sentences = [NOISE + "\n"] * lines
    positions = sorted(int(rng.random() * lines) for _ in statements)
    for offset, (position, statement) in enumerate(zip(positions, statements, strict=True)):
        sentences.insert(position + offset, statement)
    return " ".join(sentences).replace(". \n", ".\n").strip()


@dataclass(frozen=True)
class VariableTracking(SyntheticTask):
    """RULER ``vt``; ``units`` are noise lines of the question's context."""

    name: str = "vt"
    hops: int = 4
    max_new_tokens: int = 30

    min_length: int = 512

    def build(self, key: str, units: int, length: int) -> Built:
        rng = rng_for(key)
        example_rng = rng_for(key, "example")
        ex_names, ex_value, ex_statements = _chain(example_rng, self.hops, 3)
        example = _TEMPLATE.format(
            context=_context(example_rng, EXAMPLE_LINES, ex_statements), value=ex_value, count=self.hops + 1
        )
        names, value, statements = _chain(rng, self.hops, 5)
        question = _TEMPLATE.format(
            context=_context(rng_for(key, "positions"), units, statements), value=value, count=self.hops + 1
        )
        return Built(
            prompt=f"{example} {' '.join(ex_names)}\n\n{question}",
            answer=" " + " ".join(names),
            references=names,
            meta={"value": value, "noise_lines": units},
        )
