"""Evaluation tasks, generated offline and deterministically on any tokenizer: ``TASKS`` and ``get_task``.

* RULER's synthetic suite (Hsieh et al. 2024): the eight NIAH tasks (:mod:`.ruler_niah`), variable
  tracking ``vt`` (:mod:`.ruler_vt`), ``cwe`` and ``fwe`` (:mod:`.ruler_aggregation`), scored with
  RULER's ``string_match_all``. RULER's two QA tasks (``qa_1`` on SQuAD, ``qa_2`` on HotpotQA) are left
  out: they need those datasets, which are not available offline.
* ``passkey``: the needle-in-a-haystack grid (length × five depths), scored as every ``generate`` task.
* ``niah``: the grid of ``kvsieve niah`` (depths 0.1 / 0.5 / 0.9, the pass key drawn from the seed),
  scored as ``kvsieve niah`` scores it (the ``needle`` cell kind); ``kvsieve niah`` runs it with its own
  depths.
* ``multiturn``: several needles in one context, asked one per turn on the same compressed cache.
* ``perplexity`` (one token per forward, faithful to decoding-time eviction) and
  ``perplexity_chunk16`` (16 tokens per forward, ~16× cheaper): essay-text NLL by position.

Prompts are plain completion prompts (no chat template: it hurts small instruct models such as
SmolLM2-135M) ending so that the answer is the continuation. Every task builds sample ``index`` at a
target prompt ``length`` from ``(name, length, seed, index)``; generated tasks hit ``length`` within
±3% (:data:`LENGTH_TOLERANCE`; passkey ±2%, perplexity exactly).
"""

from __future__ import annotations

from kvsieve.eval.tasks.base import LENGTH_TOLERANCE, Task, TaskSample
from kvsieve.eval.tasks.multiturn import MultiTurnRetrieval
from kvsieve.eval.tasks.passkey import NiahGrid, PasskeyGrid
from kvsieve.eval.tasks.perplexity import EssayPerplexity
from kvsieve.eval.tasks.ruler_aggregation import CommonWords, FrequentWords
from kvsieve.eval.tasks.ruler_niah import NIAH_TASKS
from kvsieve.eval.tasks.ruler_vt import VariableTracking

#: RULER's synthetic tasks available offline, in RULER's order.
RULER_TASKS: tuple[str, ...] = (*(t.name for t in NIAH_TASKS), "vt", "cwe", "fwe")

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        *NIAH_TASKS,
        VariableTracking(),
        CommonWords(),
        FrequentWords(),
        PasskeyGrid(),
        NiahGrid(),
        MultiTurnRetrieval(),
        EssayPerplexity(),
        EssayPerplexity(name="perplexity_chunk16", chunk=16),
    )
}


class UnknownTaskError(KeyError):
    """Raised for a task name that is not registered; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def get_task(name: str) -> Task:
    """The registered task ``name``; raises :class:`UnknownTaskError` listing the known tasks."""
    try:
        return TASKS[name]
    except KeyError:
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


__all__ = ["LENGTH_TOLERANCE", "RULER_TASKS", "TASKS", "Task", "TaskSample", "UnknownTaskError", "get_task"]
