"""Side data of decoding entries computed later, for several steps at once.

A scorer whose per-entry side data is a function of each new token's own input alone — the learned retention gates'
``log β`` of TrimKV/DBTrimKV (Eq. 2 of the TrimKV paper: ``β = σ(g(x_t))`` from the token's attention input ``x_t``) —
need not compute it at every decoding step: nothing reads it until the layer is planned again (under
``Decode(buffer=16)``, every ~10–16 steps). The store keeps the steps' inputs and computes their values the first time
anything reads or moves its side data (:meth:`~kvsieve.cache.store_layout.StoreLayout.settle_deferred`): at a layer's
plan instead of at every layer and step. Each step's input is computed on its own, as the step would have: one matrix
product over the ``k`` steps' tokens together rounds otherwise than ``k`` products over one where the BLAS blocks ``k``
rows differently from one (an AVX2-only CPU's did: ``log β`` an ulp apart), so the values are the same bit for bit
whichever steps settle together. Only after decoding appends of one entry per segment: each pending input's entries are
then each segment's newest but as many as decoding appends came after them, which appends and growth keep and every
other change of the store settles first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class DeferredSide:
    """One side-data field's pending inputs and the function computing its values.

    ``compute`` maps a step's input ``(batch, tokens, ...)`` to its values
    ``(batch, heads, tokens, ...)``, which are *added* to the entries' side data (as an
    :class:`~kvsieve.core.step.AppendedUpdate`'s are)."""

    compute: Callable[[torch.Tensor], torch.Tensor]
    inputs: list[torch.Tensor] = field(default_factory=list)
    #: Per input, the store's count of decoding appends once its entries were appended (where they lie: the
    #: newest entries of each segment, as many back from the end as decoding appends came after them).
    appends: list[int] = field(default_factory=list)

    def values(self) -> torch.Tensor:
        """The values of every pending step's entries, ``(batch, heads, k, ...)``, in step order: each step's input
        computed on its own (module docstring)."""
        if len(self.inputs) == 1:
            return self.compute(self.inputs[0])
        return torch.cat([self.compute(step) for step in self.inputs], dim=2)

    def nbytes(self) -> int:
        """Bytes the pending inputs hold."""
        return sum(t.nbytes for t in self.inputs)

