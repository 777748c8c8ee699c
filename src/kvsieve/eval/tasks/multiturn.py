"""Multi-turn retrieval: one long context, one question per turn, all on the same compressed cache.

The context is an essay haystack (as ``niah_multikey_1``) holding ``turns`` needles
``"One of the special magic numbers for {key} is: {value}."`` at distinct RULER depths. Turn 1's
question ends the prompt; each later turn appends ``"\\nWhat is the special magic number for {key}
mentioned in the provided text? The special magic number for {key} mentioned in the provided text
is"`` after the model's previous answer (without its final newline, if it ended a line), so the cache
that answers turn ``t`` is the one compressed after every earlier turn. A policy that drops needles
the first question did not ask about fails the later turns.

``length`` fits the first prompt (the context); follow-up segments add ~30 tokens each.
``meta["turn_question_ids"][t]`` are the tokens appended before turn ``t`` (empty for turn 0),
``meta["turn_answer_ids"][t]`` the canonical answer of turn ``t`` as their continuation, and
``references[t]`` its value. Each turn is scored with ``string_match_all`` on its own answer and
generation of a turn stops at the answer, at a newline, or after ``max_new_tokens``.

On SmolLM2-135M at 1k tokens the full cache answers turn 1 every time but later turns only about half
the time: the wrong answers are *other needles'* values (4 samples checked), while the teacher-forced
log-likelihood of the right value stays between −0.4 and −2.4 nats per turn. That is the small model's
retrieval limit, not a format problem, so compare policies there by the per-turn log-likelihoods
(``turn_answer_logprobs`` against ``turn_answer_logprobs_full``) and KL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvsieve.eval.metrics import string_match_all
from kvsieve.eval.tasks.base import Built, SyntheticTask, TaskSample, continuation, rng_for
from kvsieve.eval.tasks.text import (
    DEPTHS,
    distinct,
    haystack_words,
    insert_at_depths,
    random_key,
    random_number,
    split_sentences,
)

_NEEDLE = "One of the special magic numbers for {key} is: {value}."
_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards, one at a time.\n"
)
_QUESTION = (
    "What is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)


@dataclass(frozen=True)
class MultiTurnRetrieval(SyntheticTask):
    """``turns`` needles, asked one per turn in a random order; ``units`` are essay words."""

    name: str = "multiturn"
    turns: int = 4
    max_new_tokens: int = 16  # per turn

    kind: ClassVar[str] = "multiturn"
    min_length: int = 256

    def build(self, key: str, units: int, length: int) -> Built:
        rng = rng_for(key)
        keys = distinct(rng, random_key, self.turns)
        values = [random_number(rng) for _ in keys]
        depths = sorted(d / 100 for d in rng.sample(DEPTHS, self.turns))
        order = rng.sample(range(self.turns), self.turns)
        needles = [_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
        sentences = split_sentences(" ".join(haystack_words(key, units, rng_for(key, "essay"))))
        context = " ".join(insert_at_depths(sentences, needles, depths))
        asked = [keys[i] for i in order]
        return Built(
            prompt=_INSTRUCTION + context + "\n" + _QUESTION.format(key=asked[0]),
            answer=" " + values[order[0]],
            references=[values[i] for i in order],
            meta={"keys": asked, "depths": [depths[i] for i in order], "haystack_units": units},
        )

    def extra_meta(self, tokenizer: PreTrainedTokenizerBase, built: Built) -> dict[str, Any]:
        questions: list[list[int]] = [[]]
        answers: list[list[int]] = [continuation(tokenizer, built.prompt, built.answer)[2]]
        for key, value in zip(built.meta["keys"][1:], built.references[1:], strict=True):
            segment = "\n" + _QUESTION.format(key=key)
            _, ids, answer_ids = continuation(tokenizer, segment, " " + value, special=False)
            questions.append(ids)
            answers.append(answer_ids)
        return {"turn_question_ids": questions, "turn_answer_ids": answers}

    def score_turn(self, sample: TaskSample, turn: int, generated_text: str) -> float:
        """``string_match_all`` of one turn's answer against that turn's value."""
        return string_match_all(generated_text, [sample.references[turn]])

    def turn_done(self, sample: TaskSample, turn: int, generated_text: str) -> bool:
        """A turn ends once its value is produced or a line ends."""
        return "\n" in generated_text or self.score_turn(sample, turn, generated_text) >= 1.0
