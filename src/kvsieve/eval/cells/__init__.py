"""Cell runners, one module per task kind, and :data:`KINDS`: how :mod:`kvsieve.eval.evaluate` runs each.

A runner takes a :class:`~kvsieve.eval.cells.context.CellContext` (one task sample under one cache,
possibly prefilled by a shared forward) and returns the kind's record fields:

* ``generate`` (:mod:`.generate`): one prompt, one answer; RULER's tasks and the sweep's ``passkey``;
* ``multiturn`` (:mod:`.multiturn`): one question per turn on the same cache;
* ``perplexity`` (:mod:`.perplexity`): text streamed through the cache (never a shared prefill);
* ``needle`` (:mod:`.needle`): ``kvsieve niah``'s passkey scoring; its full cache is transformers'
  ``DynamicCache``, the plain baseline its speed and memory are compared with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvsieve.eval.cells.context import CellContext
from kvsieve.eval.cells.generate import generate_cell
from kvsieve.eval.cells.multiturn import multiturn_cell
from kvsieve.eval.cells.needle import needle_cell, score_sample
from kvsieve.eval.cells.perplexity import perplexity_cell


@dataclass(frozen=True)
class CellKind:
    """How cells of one task kind run.

    Attributes:
        run: the runner.
        shares_prefill: the kind starts from the prompt's prefill, which one forward may fill for
            several caches (:func:`kvsieve.engine.shared_prefill.prefill_shared`).
        plain_full: the full cache is transformers' ``DynamicCache`` rather than ``KVCache(model, "full")``.
    """

    run: Callable[[CellContext], dict[str, Any]]
    shares_prefill: bool = True
    plain_full: bool = False


KINDS: dict[str, CellKind] = {
    "generate": CellKind(generate_cell),
    "multiturn": CellKind(multiturn_cell),
    "perplexity": CellKind(perplexity_cell, shares_prefill=False),
    "needle": CellKind(needle_cell, plain_full=True),
}

__all__ = ["KINDS", "CellContext", "CellKind", "score_sample"]
