"""Perplexity of essay text under decoding-time eviction (streaming policies).

A sample is exactly ``length`` tokens of whitespace-collapsed essay text starting at an essay and a
word offset drawn from the seed (the same text for every chunking, so ``perplexity`` and
``perplexity_chunk16`` compare directly). The evaluation feeds it through a cache and records the
negative log-likelihood of every next token by position: perplexity overall and per position bucket
of :attr:`bucket` tokens.

How the text is fed (``kvsieve.eval.evaluate``):

* the first ``max(start, budget)`` tokens in one forward (prefill). Up to the budget nothing is
  evicted under any schedule, so this equals feeding them one at a time;
* then ``chunk`` tokens per forward. ``chunk = 1`` is the faithful setting for decoding-time
  eviction (``schedule="decode"``/``"blockwise"``): every token is a decoding step and the cache is
  cut back to its budget before the next one. With ``chunk = c > 1`` each forward is a small prompt:
  its tokens attend to each other and to the cache, then the cache evicts once, so a token may see up
  to ``budget + c - 1`` entries; the NLL is slightly optimistic but ~``c`` times cheaper (one forward
  per token costs ~0.1 s on this CPU for SmolLM2-135M).

``prefill``-schedule policies compress after every multi-token forward only, so with ``chunk = 1``
they hold everything after the prefill; this task is meant for ``streaming_llm``, ``h2o``, ``tova``
with ``schedule="decode"`` and the ``blockwise`` schedule. The full-cache reference is computed in
chunks of 256 tokens (the full cache is exact in any chunking). ``score`` is ``exp(-mean NLL)`` (the
geometric-mean probability of the next token, ``1 / perplexity``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from transformers import PreTrainedTokenizerBase

from kvsieve.eval.tasks.base import Task, TaskSample, rng_for, sample_key
from kvsieve.eval.tasks.text import essay_pool, num_essays, take_words


@dataclass(frozen=True)
class EssayPerplexity(Task):
    """Next-token NLL of ``length`` essay tokens fed ``chunk`` tokens per forward after a prefill."""

    name: str = "perplexity"
    chunk: int = 1
    text: str = "perplexity"  # seeds the text: variants that differ only in chunking read the same text
    start: int = 64
    bucket: int = 256
    max_new_tokens: int = 0

    kind: ClassVar[str] = "perplexity"
    metric: ClassVar[str] = "perplexity"
    min_length: int = 64

    def make_sample(self, tokenizer: PreTrainedTokenizerBase, length: int, index: int, seed: int) -> TaskSample:
        self.check_length(length)
        rng = rng_for(sample_key(self.text, length, seed, index))
        pool = essay_pool(seed)  # the calibration / held-out split of the seed (all essays for ordinary seeds)
        essay, offset = rng.randrange(len(pool)), rng.randrange(2000)
        chosen = None if len(pool) == num_essays() else pool
        words = 2 * length
        while True:
            text = " ".join(take_words(essay, offset + words, chosen)[offset:])
            ids = tokenizer(text).input_ids
            if len(ids) >= length:
                break
            words *= 2
        return TaskSample(
            task=self.name,
            index=index,
            seed=seed,
            prompt_ids=list(ids[:length]),
            references=[],
            answer_ids=[],
            context_tokens=length,
            meta={
                "essay": essay, "word_offset": offset, "chunk": self.chunk, "start": self.start, "bucket": self.bucket,
            },
            prompt=tokenizer.decode(ids[:length]),
        )

    def score(self, sample: TaskSample, generated_text: str) -> float:
        raise TypeError("perplexity is scored from next-token NLLs (see score_nll), not from generated text")

    def done(self, sample: TaskSample, generated_text: str) -> bool:
        return True

    @staticmethod
    def score_nll(mean_nll: float) -> float:
        """``exp(-mean NLL)``: 1 / perplexity, in (0, 1]."""
        return math.exp(-mean_nll)
