"""When compaction fires: the one place that answers "does it fire now".

* :class:`Prefill` — after every multi-token forward (each prompt, or each turn's prompt); never while
  decoding. SnapKV-style: the prompt attends to its whole self first.
* :class:`Decode` — like ``Prefill`` for prompts, and at decoding steps whenever a head holds more than
  ``budget + buffer`` entries (``buffer`` 0 = one eviction per step; larger buffers amortise it).
* :class:`Blockwise` — CAOTE's setting (Goel et al., 2025, arXiv:2504.14051, Sec. 2; blocks of 128 in Sec. 4):
  each prompt is processed in blocks of ``block_size`` queries *per layer*, evicting back to the budget after
  every block, so a head never holds more than ``budget + block_size`` entries; then like ``Decode``.

Global allocators (one budget over all layers and heads) compare the total a batch row holds with the
total budget instead of each head with its own (see :meth:`Schedule.fires_total`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvsieve.core.part import Part, require_int


@dataclass(frozen=True)
class Schedule(Part):
    """Base schedule: fires after prompts only."""

    kind: ClassVar[str] = "schedule"
    #: Whether this schedule can act with a ratio budget (a fraction of a growing cache is undefined).
    accepts_ratio: ClassVar[bool] = True

    def block_length(self) -> int | None:
        """Queries per block of a multi-token forward (None: the whole forward at once)."""
        return None

    @property
    def acts_while_decoding(self) -> bool:
        return False

    def fires(self, decoding: bool, max_length: int, budget: int | None) -> bool:
        """Whether a layer holding at most ``max_length`` entries per head compacts after this forward."""
        return not decoding

    def fires_total(self, decoding: bool, total: int, total_budget: int | None, heads: int) -> bool:
        """The same question for a global budget: ``total`` entries held by a batch row in all heads, against
        ``total_budget`` plus ``buffer`` for each of the ``heads`` heads (of every managed layer)."""
        return not decoding

    def row_limit(self, decoding: bool, budget: int | None) -> int | None:
        """Rows of a batch are independent requests: when the schedule fires, only rows whose longest head
        holds more than this compact (None: every row). The same rule as :meth:`fires`, per row."""
        return None

    def decoding_reserve(self) -> int:
        """Free rows a compaction at a decoding step leaves per head: the appends until the schedule fires
        again, so they are written in place (no more than the head will hold by then)."""
        return 0


@dataclass(frozen=True)
class Prefill(Schedule):
    """Compress after every multi-token forward (every prompt)."""

    name: ClassVar[str] = "prefill"


@dataclass(frozen=True)
class Decode(Schedule):
    """Compress every prompt, then at decoding whenever a head exceeds ``budget + buffer``."""

    name: ClassVar[str] = "decode"
    accepts_ratio: ClassVar[bool] = False
    buffer: int = 0

    def validate(self) -> None:
        require_int(self.name, "buffer", self.buffer, 0)

    @property
    def acts_while_decoding(self) -> bool:
        return True

    def fires(self, decoding: bool, max_length: int, budget: int | None) -> bool:
        if not decoding:
            return True
        return budget is not None and max_length > budget + self.buffer

    def decoding_reserve(self) -> int:
        return self.buffer + 1

    def fires_total(self, decoding: bool, total: int, total_budget: int | None, heads: int) -> bool:
        if not decoding:
            return True
        return total_budget is not None and total > total_budget + self.buffer * heads

    def row_limit(self, decoding: bool, budget: int | None) -> int | None:
        return budget + self.buffer if decoding and budget is not None else None


@dataclass(frozen=True)
class Blockwise(Schedule):
    """Prompts in blocks of ``block_size`` queries per layer, evicting to the budget after each block."""

    name: ClassVar[str] = "blockwise"
    accepts_ratio: ClassVar[bool] = False
    block_size: int = 128
    buffer: int = 0

    def validate(self) -> None:
        require_int(self.name, "block_size", self.block_size, 1)
        require_int(self.name, "buffer", self.buffer, 0)

    def block_length(self) -> int | None:
        return self.block_size

    @property
    def acts_while_decoding(self) -> bool:
        return True

    def fires(self, decoding: bool, max_length: int, budget: int | None) -> bool:
        if budget is None:
            return False
        return max_length > budget + (self.buffer if decoding else 0)

    def fires_total(self, decoding: bool, total: int, total_budget: int | None, heads: int) -> bool:
        if total_budget is None:
            return False
        return total > total_budget + (self.buffer * heads if decoding else 0)

    def row_limit(self, decoding: bool, budget: int | None) -> int | None:
        return None if budget is None else budget + (self.buffer if decoding else 0)
