"""Scorer: which held entries matter. A pure tensor function of the statistics it declares.

``score(step, nominal)`` returns ``(batch, kv_heads, L)`` scores over the dense view's entries (higher =
keep), ``+inf`` on entries the method always keeps (SnapKV's window, H2O's recent share, sinks) and
``-inf`` on padding slots. ``nominal`` ``(batch, kv_heads)`` is the per-head budget the allocator
starts from (before any redistribution), for the methods whose score depends on it (H2O's recent
share, ReST-KV's top-``B`` drift). Scorers that keep running statistics (H2O's accumulated attention)
return additive updates of their side data from :meth:`Scorer.observe`; the engine applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvsieve.cache.store import SideSpec
from kvsieve.core.part import Part, PolicyConfigError
from kvsieve.core.step import AppendedUpdate, DeferredUpdate, LayerStep

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec

ALL_SCHEDULES = ("prefill", "decode", "blockwise")


def protect_recent(scores: torch.Tensor, step: LayerStep, recent: int | torch.Tensor) -> torch.Tensor:
    """Give +inf to the ``recent`` newest entries of each head and -inf to padding slots."""
    lengths = step.lengths()
    offsets = torch.arange(scores.shape[-1], device=scores.device)
    # a Python int stays one (no host-to-device copy, which waits for the device)
    recent_t = recent.to(scores.device) if isinstance(recent, torch.Tensor) else recent
    is_recent = offsets.view(1, 1, -1) >= (lengths - recent_t).unsqueeze(-1)
    out = scores.float().masked_fill(is_recent, math.inf)
    valid = step.view.valid
    return out if valid is None else out.masked_fill(~valid, -math.inf)


def protect_sinks_and_recent(scores: torch.Tensor, step: LayerStep, sinks: int, recent: int) -> torch.Tensor:
    """:func:`protect_recent`, and ``+inf`` on the first ``sinks`` *real* tokens of each row (by position among
    the row's real tokens, so a padded row protects what it would alone: Expected Attention's and KVzip's
    attention sinks)."""
    out = protect_recent(scores, step, recent)
    if sinks:
        first = step.real_positions(step.view.positions) < sinks
        out = out.masked_fill(first & step.entry_valid(), math.inf)
    return out


def check_sinks_and_window(spec: BudgetSpec, sinks: int, window: int) -> None:
    """Refuse ``sinks + window`` entries always kept over the per-head budget (naming both and the range)."""
    if spec.budget is not None and sinks + window > spec.budget:
        raise PolicyConfigError(
            f"{spec.name}: n_sink ({sinks}) + window ({window}) must not exceed budget ({spec.budget}): both are "
            f"always kept; allowed n_sink range is [0, {max(spec.budget - window, 0)}]"
        )


@dataclass(frozen=True)
class Scorer(Part):
    """Base scorer. Subclasses implement :meth:`raw` (and :meth:`protect` when they keep more than a window)."""

    kind: ClassVar[str] = "scorer"
    #: Schedules the score makes sense under (SnapKV's window is the prompt's: no ``decode``).
    SCHEDULES: ClassVar[tuple[str, ...]] = ("prefill", "blockwise")
    #: Statistics read from the :class:`LayerStep` (see :data:`kvsieve.core.step.STATISTICS`).
    NEEDS: ClassVar[frozenset[str]] = frozenset()
    #: Per-entry side data kept in the cache.
    SIDE: ClassVar[tuple[SideSpec, ...]] = ()
    #: :meth:`observe` returns nothing outside probe forwards (KVzip): an ordinary decoding step observes nothing.
    OBSERVES_PROBES_ONLY: ClassVar[bool] = False
    #: The side data that is this scorer's raw score, to which :meth:`observe` adds each query's attention row averaged
    #: over its KV head's query heads (H2O's accumulator); None: the scorer scores otherwise. An engine may then
    #: observe, plan and drop one entry per head in one pass at an every-step decoding step
    #: (:meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_lowest`), as long as the class that declares it
    #: is the one whose :meth:`observe`, :meth:`raw` and :meth:`protect` run.
    ACCUMULATES_ROWS: ClassVar[str | None] = None

    def schedules(self) -> tuple[str, ...]:
        return self.SCHEDULES

    def needs(self) -> frozenset[str]:
        return self.NEEDS

    def side(self) -> tuple[SideSpec, ...]:
        return self.SIDE

    def protected_window(self) -> int:
        """Newest entries always kept (the observation window; 0 when the method has none)."""
        return int(getattr(self, "window", 0) or 0)

    def check(self, spec: BudgetSpec) -> None:
        window = self.protected_window()
        if spec.budget is not None and window > spec.budget:
            raise PolicyConfigError(
                f"{spec.name}: window ({window}) must not exceed budget ({spec.budget}); "
                f"allowed window range is [0, {spec.budget}]"
            )

    def decoding_updates(self, layer_idx: int, kv_heads: int, inputs: torch.Tensor) -> dict[str, DeferredUpdate] | None:
        """What :meth:`observe` returns at a decoding step of one real token per row, when it only defers side data
        computed from the step's layer ``inputs`` ``(batch, 1, hidden)`` (the retention gates): the engine's plain
        decoding step then appends, defers and attends without describing the step. None (the default): the scorer
        observes otherwise."""
        return None

    def scores_from_row(self, rows: torch.Tensor, kv_heads: int) -> torch.Tensor | None:
        """A decoding step's raw scores from its query's float32 softmax rows alone, ``(batch, q_heads, 1, L)`` over a
        uniform store's held entries without padding, exactly as :meth:`raw` gives them there: ``(batch, kv_heads, L)``,
        or ``(batch, 1, L)`` shared by the KV heads of a batch item — what :meth:`raw` gives only where the item's heads
        hold the same positions (the caller checks, and takes :meth:`raw` otherwise). An engine may then plan and drop
        one entry per head in one pass at an every-step decoding step
        (:meth:`~kvsieve.cache.store_compaction.StoreCompaction.drop_lowest_scored`), as long as the class that
        defines it is the one whose :meth:`raw` and :meth:`protect` run and it observes nothing. None (the default):
        the score reads more than the row."""
        return None

    def observe(self, step: LayerStep) -> dict[str, torch.Tensor | AppendedUpdate | DeferredUpdate]:
        """Additive updates after every forward (default: none): ``{side name: (batch, kv_heads, L, ...)}`` over
        the dense view, an :class:`~kvsieve.core.step.AppendedUpdate` for the forward's new entries only, or a
        :class:`~kvsieve.core.step.DeferredUpdate` computing a decoding step's later, with other steps'."""
        return {}

    def raw(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        """Unprotected scores ``(batch, kv_heads, L)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement raw()")

    def protect(self, scores: torch.Tensor, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        """``+inf`` on always-kept entries, ``-inf`` on padding (default: the newest ``window``)."""
        return protect_recent(scores, step, self.protected_window())

    def score(self, step: LayerStep, nominal: torch.Tensor) -> torch.Tensor:
        return self.protect(self.raw(step, nominal), step, nominal)

    def kept_newest(self, budget: int) -> int | None:
        """How many newest entries :meth:`protect` sets to ``+inf`` when every head's nominal budget is ``budget``
        and nothing is padding, if that is all it does and :meth:`raw` never gives ``+inf`` (then an engine may take
        the lowest raw score among the older entries instead of protecting); None otherwise (sinks...). Default: the
        :meth:`protected_window` of the base :meth:`protect`; a subclass overriding :meth:`protect` says its own."""
        return self.protected_window() if type(self).protect is Scorer.protect else None

    def bind(self, model: torch.nn.Module) -> Scorer:
        """This scorer ready for ``model`` (learned scorers load their weights here; default: itself)."""
        return self
