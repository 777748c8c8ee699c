"""The task contract: :class:`TaskSample`, :class:`Task`, and length fitting for synthetic generators.

A task builds samples deterministically from ``(task name, length, seed, index)`` on any tokenizer:
sample ``index`` never depends on the samples before it, so a runner can build exactly the one it
needs. ``length`` is the target **prompt** length in tokens (RULER's ``max_seq_length`` also counts the
tokens to generate; here it is what the KV cache holds after prefill). Generators built on
:class:`SyntheticTask` hit it within :data:`LENGTH_TOLERANCE` (±3%).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvsieve.eval.metrics import METRICS

#: Relative tolerance on the prompt length: ``|len(prompt_ids) - length| <= LENGTH_TOLERANCE * length``.
LENGTH_TOLERANCE = 0.03
_ATTEMPTS = 12


@dataclass(frozen=True)
class TaskSample:
    """One prompt, its references and the canonical answer as a continuation of the prompt.

    Attributes:
        task, index, seed: what the sample was built from (with ``context_tokens``).
        prompt_ids: the prompt's token ids (with the tokenizer's own special tokens, if it adds any).
        references: strings the output is scored against (the task's metric).
        answer_ids: the canonical answer's tokens as the continuation of ``prompt_ids`` (teacher forcing).
        context_tokens: the requested prompt length; ``len(prompt_ids)`` is within the task's tolerance.
        meta: JSON-serialisable details (needle depths, keys, per-turn token ids...).
        prompt, answer: the prompt text and canonical answer text (not part of equality).
    """

    task: str
    index: int
    seed: int
    prompt_ids: list[int]
    references: list[str]
    answer_ids: list[int]
    context_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)
    prompt: str = field(default="", repr=False, compare=False)
    answer: str = field(default="", repr=False, compare=False)

    @property
    def prompt_tokens(self) -> int:
        """Actual prompt length in tokens."""
        return len(self.prompt_ids)


class Task(ABC):
    """A family of samples plus how to score a generation.

    Attributes:
        name: registry name.
        max_new_tokens: generation budget (per turn for multi-turn tasks; 0 for perplexity).
        kind: ``"generate"`` (one prompt, one answer), ``"multiturn"``, ``"perplexity"`` or ``"needle"``
            (``kvsieve niah``'s scoring); :data:`kvsieve.eval.cells.KINDS` runs each.
        metric: a key of :data:`kvsieve.eval.metrics.METRICS` (RULER: ``string_match_all`` for every
            synthetic task, ``string_match_part`` for QA).
        min_length: shortest prompt the generator can build.
    """

    name: str
    max_new_tokens: int
    kind: ClassVar[str] = "generate"
    metric: ClassVar[str] = "string_match_all"
    min_length: int = 256

    def make_samples(
        self, tokenizer: PreTrainedTokenizerBase, length: int, num_samples: int, seed: int
    ) -> list[TaskSample]:
        """Samples ``0 .. num_samples - 1`` (each as :meth:`make_sample` builds it)."""
        return [self.make_sample(tokenizer, length, index, seed) for index in range(num_samples)]

    @abstractmethod
    def make_sample(self, tokenizer: PreTrainedTokenizerBase, length: int, index: int, seed: int) -> TaskSample:
        """Sample ``index``, deterministic in ``(self.name, length, seed, index)``."""

    def score(self, sample: TaskSample, generated_text: str) -> float:
        """The task's metric of ``generated_text`` against ``sample.references``, in [0, 1]."""
        return METRICS[self.metric](generated_text, sample.references)

    def done(self, sample: TaskSample, generated_text: str) -> bool:
        """True once more generated text cannot change the score (generation may stop early).

        For the string-match metrics that is a perfect score (a longer output only adds matches).
        """
        if self.metric in ("string_match_all", "string_match_part"):
            return self.score(sample, generated_text) >= 1.0
        return False

    def check_length(self, length: int) -> None:
        if length < self.min_length:
            raise ValueError(f"{self.name}: length must be ≥ {self.min_length} tokens; got {length}")


def sample_key(name: str, length: int, seed: int, index: int) -> str:
    """The string a sample's random generator is seeded with (``random.Random(str)`` is stable)."""
    return f"kvsieve/{name}/{length}/{seed}/{index}"


def continuation(
    tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str, special: bool = True
) -> tuple[str, list[int], list[int]]:
    """Prompt text, prompt ids and answer ids such that the answer continues the prompt token-wise.

    When ``answer`` starts with a space the tokenizer keeps as a token of its own before it (SmolLM2
    before digits: ``"is 1234"`` is ``Ġis Ġ 1 2 3 4``), the space moves to the end of the prompt, so
    the answer starts with its first real token instead of a bare space (see :mod:`kvsieve.eval.tasks.passkey_prompt`).
    ``special`` adds the tokenizer's special tokens (False for follow-up turns).
    """
    full = tokenizer(prompt + answer, add_special_tokens=special).input_ids
    if answer.startswith(" "):
        spaced = tokenizer(prompt + " ", add_special_tokens=special).input_ids
        if full[: len(spaced)] == spaced and len(full) > len(spaced):
            return prompt + " ", list(spaced), list(full[len(spaced) :])
    ids = tokenizer(prompt, add_special_tokens=special).input_ids
    if full[: len(ids)] == ids and len(full) > len(ids):
        return prompt, list(ids), list(full[len(ids) :])
    return prompt, list(ids), list(tokenizer(answer, add_special_tokens=False).input_ids)


@dataclass(frozen=True)
class Built:
    """What a generator produced for one unit count: prompt text, canonical answer, references, meta."""

    prompt: str
    answer: str
    references: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


def closest_count(count: Callable[[int], int], target: int, low: int) -> int:
    """The unit count ``n ≥ low`` whose token count is closest to ``target`` (counts grow with ``n``).

    Extrapolates from the tokens per unit seen so far until it brackets ``target``, then bisects.
    """
    memo: dict[int, int] = {}

    def tokens(n: int) -> int:
        if n not in memo:
            memo[n] = count(n)
        return memo[n]

    if tokens(low) >= target:
        return low
    lo, hi = low, low + 1
    for _ in range(64):
        if tokens(hi) >= target:
            break
        per_unit = max((tokens(hi) - tokens(lo)) / (hi - lo), 1e-3)
        lo, hi = hi, hi + max(1, int(1.1 * (target - tokens(hi)) / per_unit) + 1)
    else:
        raise RuntimeError(f"could not reach {target} tokens (stuck at {tokens(hi)} with {hi} units)")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens(mid) < target:
            lo = mid
        else:
            hi = mid
    return lo if target - tokens(lo) <= tokens(hi) - target else hi


class SyntheticTask(Task):
    """A generator with one size knob (``units``: haystack words, lines, list entries...).

    Subclasses implement :meth:`build`, deterministic in ``(key, units, length)``. :meth:`make_sample`
    searches the unit count that brings the prompt closest to ``length`` tokens; when the units are
    coarse (a 76-token UUID line) and the closest count still misses the tolerance, it redraws the
    sample's randomness (``key + ":<attempt>"``, still deterministic) and searches again.
    """

    min_units: ClassVar[int] = 1

    @abstractmethod
    def build(self, key: str, units: int, length: int) -> Built:
        """The sample drawn from ``random.Random(key)`` with ``units`` units (``length``: the target)."""

    def extra_meta(self, tokenizer: PreTrainedTokenizerBase, built: Built) -> dict[str, Any]:
        """Tokenizer-dependent meta added to the sample (default: none)."""
        return {}

    def make_sample(self, tokenizer: PreTrainedTokenizerBase, length: int, index: int, seed: int) -> TaskSample:
        self.check_length(length)
        base = sample_key(self.name, length, seed, index)
        tolerance = max(1, int(LENGTH_TOLERANCE * length))
        best: tuple[int, Built, str, list[int], list[int]] | None = None
        for attempt in range(_ATTEMPTS):
            key = f"{base}:{attempt}"

            def count(units: int, key: str = key) -> int:
                return len(tokenizer(self.build(key, units, length).prompt).input_ids)

            units = closest_count(count, length, self.min_units)
            built = self.build(key, units, length)
            prompt, prompt_ids, answer_ids = continuation(tokenizer, built.prompt, built.answer)
            miss = len(prompt_ids) - length
            if best is None or abs(miss) < abs(best[0]):
                best = (miss, built, prompt, prompt_ids, answer_ids)
            if abs(miss) <= tolerance:
                break
        assert best is not None
        miss, built, prompt, prompt_ids, answer_ids = best
        if abs(miss) > tolerance:
            raise RuntimeError(f"{self.name}: could not build a {length}-token prompt (off by {miss} tokens)")
        return TaskSample(
            task=self.name,
            index=index,
            seed=seed,
            prompt_ids=prompt_ids,
            references=list(built.references),
            answer_ids=answer_ids,
            context_tokens=length,
            meta={**built.meta, **self.extra_meta(tokenizer, built)},
            prompt=prompt,
            answer=built.answer,
        )


def rng_for(key: str, stream: str = "") -> random.Random:
    """A generator seeded by ``key`` (and a named sub-stream, so draws in one stream never shift another)."""
    return random.Random(f"{key}#{stream}" if stream else key)
