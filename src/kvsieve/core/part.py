"""The five kinds of part a policy composes, and the checks every part uses.

A policy (:class:`kvsieve.policies.policy.Policy`) is a *scorer* (which entries matter), an *allocator*
(how many each layer/head keeps), an *action* (what happens to the rest: evict, merge), an optional
*selector* (decoding-time subset attention that deletes nothing) and a *schedule* (when compaction
fires). Each part is a small frozen dataclass whose fields are its paper's hyper-parameters with the
paper's defaults; it validates its own fields on construction, and :meth:`Part.check` validates what
depends on the rest of the policy (e.g. a window no larger than the budget) before any work is done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvsieve.core.budget import BudgetSpec


class PolicyConfigError(ValueError):
    """A policy parameter is out of range or a combination of parts cannot work."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def require_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise unless ``value`` is an int in ``[low, high]`` (no upper bound when ``high`` is None)."""
    if not is_int(value) or value < low or (high is not None and value > high):  # type: ignore[operator]
        bound = f"in [{low}, {high}]" if high is not None else f"≥ {low}"
        raise PolicyConfigError(f"{owner}: {name} must be an int {bound}; got {value!r}")


def require_number(
    owner: str, name: str, value: object, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    """Raise unless ``value`` is a real number (not a bool) in the given interval."""
    ok = is_number(value)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise PolicyConfigError(f"{owner}: {name} must be a number in {left}{low}, {high}{right}; got {value!r}")


def require_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise PolicyConfigError(f"{owner}: {name} must be True or False; got {value!r}")


def require_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PolicyConfigError(f"{owner}: {name} must be one of {choices}; got {value!r}")


@dataclass(frozen=True)
class Part:
    """Base of every part: a frozen dataclass that validates itself on construction."""

    #: ``"scorer"``, ``"allocator"``, ``"action"``, ``"selector"`` or ``"schedule"``.
    kind: ClassVar[str] = ""
    #: Short name used in ``str()``, ``kvsieve list`` and string shorthands (``allocator="adaptive"``).
    name: ClassVar[str] = ""
    #: Extra keyword names a preset routes to a field of this part (``{"floor_alpha": "alpha"}``).
    aliases: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check this part's own fields; raise :class:`PolicyConfigError` naming the field and its range."""

    def check(self, spec: BudgetSpec) -> None:
        """Check what depends on the rest of ``policy`` (budget, other parts)."""

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" if not isinstance(v, Part) else f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}({inner})"
