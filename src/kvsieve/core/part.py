"""The five kinds of part a policy composes, the checks every part uses, and the registry of parts.

A policy (:class:`kvsieve.policies.policy.Policy`) is a *scorer* (which entries matter), an *allocator*
(how many each layer/head keeps), an *action* (what happens to the rest: evict, merge), an optional
*selector* (decoding-time subset attention that deletes nothing) and a *schedule* (when compaction
fires). Each part is a small frozen dataclass whose fields are its paper's hyper-parameters with the
paper's defaults; it validates its own fields on construction, and :meth:`Part.check` validates what
depends on the rest of the policy (e.g. a window no larger than the budget) before any work is done.

**Parts register themselves**: a subclass that sets its own ``name`` is recorded under ``(kind, name)``
when its class statement runs (``__init_subclass__``), so a new method is one file — the name works in
``allocator="adaptive"``, ``scorer="snapkv"`` and ``kvsieve list`` without any list to edit.
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


def require_odd_int(owner: str, name: str, value: object) -> None:
    """Raise unless ``value`` is an odd int ≥ 1 (a pooling or smoothing kernel centred on its entry)."""
    if not is_int(value) or value < 1 or value % 2 == 0:  # type: ignore[operator]
        raise PolicyConfigError(f"{owner}: {name} must be an odd int ≥ 1; got {value!r}")


def require_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise PolicyConfigError(f"{owner}: {name} must be True or False; got {value!r}")


def require_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PolicyConfigError(f"{owner}: {name} must be one of {choices}; got {value!r}")


#: The kinds of part, in the order parameters are routed to them (see :mod:`kvsieve.policies.presets`).
PART_KINDS = ("scorer", "allocator", "action", "selector", "schedule")

_REGISTRY: dict[str, dict[str, type[Part]]] = {kind: {} for kind in PART_KINDS}


def registered_parts(kind: str) -> dict[str, type[Part]]:
    """Every part class of ``kind`` registered so far, by name (see :mod:`kvsieve.policies.catalog`, which
    first imports every module of :mod:`kvsieve.parts`)."""
    if kind not in _REGISTRY:
        raise PolicyConfigError(f"kind must be one of {PART_KINDS}; got {kind!r}")
    return dict(_REGISTRY[kind])


@dataclass(frozen=True)
class Part:
    """Base of every part: a frozen dataclass that validates itself on construction."""

    #: ``"scorer"``, ``"allocator"``, ``"action"``, ``"selector"`` or ``"schedule"``.
    kind: ClassVar[str] = ""
    #: Short name used in ``str()``, ``kvsieve list`` and string shorthands (``allocator="adaptive"``).
    name: ClassVar[str] = ""
    #: Extra keyword names a preset routes to a field of this part (``{"floor_alpha": "alpha"}``).
    aliases: ClassVar[dict[str, str]] = {}

    #: Fields the policy sets from its budget (a selector's ``k``): never passed as parameters.
    budget_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if not name:
            return  # an abstract base, or a subclass that keeps its parent's name
        if cls.kind not in _REGISTRY:
            raise TypeError(f"{cls.__qualname__}: kind must be one of {PART_KINDS}; got {cls.kind!r}")
        known = _REGISTRY[cls.kind].get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"{cls.__qualname__}: the {cls.kind} name {name!r} is taken by "
                            f"{known.__module__}.{known.__qualname__}")
        _REGISTRY[cls.kind][name] = cls

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
