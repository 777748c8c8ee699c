"""Probe forwards: tokens run through the model only to score what the cache holds.

KVzip (Kim et al. 2025, arXiv:2505.23416) scores a context by how much attention each of its entries gets
while the model is made to *repeat* the context. Those repeat tokens must attend to the held entries (and
causally to each other), so they are appended like any prompt, but they are not part of the conversation:
after each probe forward every layer drops the probe's own entries and its token count goes back to the
context's. Only the final probe plans (a reconstructing scorer never plans on ordinary forwards), so the
cache is compressed once, from the probe's scores, exactly as a prompt's plan is made and deferred.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Probe:
    """A probe forward in progress: the tokens the cache held before it, and whether it is the last one."""

    context_seen: int
    final: bool


class ProbedEngine(Protocol):
    probe: Probe | None


@contextmanager
def probing(engine: ProbedEngine, context_seen: int, final: bool) -> Iterator[None]:
    """Run the block's forwards as probes of a cache that held ``context_seen`` tokens before them."""
    if engine.probe is not None:
        raise RuntimeError("a probe forward is already running on this cache")
    engine.probe = Probe(context_seen, final)
    try:
        yield
    finally:
        engine.probe = None
