"""``Preset``: a named method as part objects with the paper's defaults.

Each method file in :mod:`kvsieve.parts` ends with its presets (a module-level ``PRESETS`` tuple);
:mod:`kvsieve.policies.catalog` discovers them, ``kvsieve list`` shows them and
:func:`kvsieve.make_policy` builds them. A preset is data, not code: its parts are frozen part objects
(``WindowAttention()``, ``Caote(base=AccumulatedAttention())``), and every parameter a caller passes is
routed to the part that declares a field of that name (:func:`routable_fields`), so no method needs a
special case in the routing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvsieve.core.part import PART_KINDS, Part, PolicyConfigError

#: Parameters of the policy itself (not of a part).
POLICY_PARAMS = ("budget", "ratio", "expand_gqa", "fuse_statistics")

#: Fields of the schedules a policy can switch to (``schedule="decode", buffer=16``).
SCHEDULE_PARAMS = ("buffer", "block_size")


@dataclass(frozen=True)
class Preset:
    """A named method: its parts (objects carrying the method's defaults) and a one-line summary.

    Attributes:
        name: the name ``KVCache(model, name)`` takes (lower case, digits, ``_``).
        summary: one line for ``kvsieve list``.
        scorer, allocator, action, selector, schedule: the parts; None: the policy's default (no scorer,
            ``Uniform``, ``Evict``, no selector, ``Prefill``).
        aliases: other names of a part kind this preset accepts (``adakv``: ``base`` for ``scorer``).
        routes: parameter → part kind, for a name two of the preset's parts declare (``adakv``: ``alpha``
            is the allocator's, whatever the base scorer); otherwise the first part in
            :data:`~kvsieve.core.part.PART_KINDS` order that declares it takes it.
    """

    name: str
    summary: str
    scorer: Part | None = None
    allocator: Part | None = None
    action: Part | None = None
    selector: Part | None = None
    schedule: Part | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    routes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise PolicyConfigError(f"preset name must be lower case letters, digits and _; got {self.name!r}")
        for kind in PART_KINDS:
            part = getattr(self, kind)
            if part is not None and (not isinstance(part, Part) or part.kind != kind):
                raise PolicyConfigError(f"{self.name}: {kind} must be a {kind} part object or None; got {part!r}")
        for alias, kind in self.aliases.items():
            if kind not in PART_KINDS:
                raise PolicyConfigError(f"{self.name}: alias {alias!r} must name one of {PART_KINDS}; got {kind!r}")
        for param, kind in self.routes.items():
            if kind not in PART_KINDS:
                raise PolicyConfigError(f"{self.name}: route {param!r} must name one of {PART_KINDS}; got {kind!r}")

    def parts(self) -> dict[str, Part | None]:
        return {kind: getattr(self, kind) for kind in PART_KINDS}

    @property
    def needs_budget(self) -> bool:
        """Whether the method takes a budget (it scores entries or selects them)."""
        return self.scorer is not None or self.selector is not None

    @property
    def deletes(self) -> bool:
        """Whether the method removes entries (a scorer with a deleting action; ``mark`` deletes nothing)."""
        return self.scorer is not None and (self.action is None or bool(getattr(self.action, "deletes", True)))

    def parameters(self, **replaced: Part | None) -> list[str]:
        """Every parameter this preset accepts, with parts replaced (``scorer=`` another part object)."""
        names = [*POLICY_PARAMS, *PART_KINDS, *self.aliases, *SCHEDULE_PARAMS]
        parts = {**self.parts(), **replaced}
        for kind in PART_KINDS:
            part = parts[kind]
            if part is not None:
                names += [name for name in routable_fields(part) if name not in names]
        return names


def routable_fields(part: Part) -> dict[str, tuple[str, ...]]:
    """Parameter name → path of the field it sets in ``part`` (nested parts included: ``Caote``'s base's
    ``window`` is ``("base", "window")``), with the part's aliases; fields set from the budget
    (``budget_fields``) and fields holding parts are not parameters."""
    out: dict[str, tuple[str, ...]] = {}
    for item in fields(part):
        if item.name in part.budget_fields:
            continue
        value = getattr(part, item.name)
        if isinstance(value, Part):
            for name, path in routable_fields(value).items():
                out.setdefault(name, (item.name, *path))
        else:
            out.setdefault(item.name, (item.name,))
    for alias, target in part.aliases.items():
        out.setdefault(alias, (target,))
    return out


def with_fields(part: Part, changes: Mapping[tuple[str, ...], Any]) -> Part:
    """``part`` with the (possibly nested) fields at the given paths set, each part rebuilt once (so fields
    that depend on each other are validated together)."""
    own = {path[0]: value for path, value in changes.items() if len(path) == 1}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in changes.items():
        if len(path) > 1:
            nested.setdefault(path[0], {})[path[1:]] = value
    for head, inner in nested.items():
        own[head] = with_fields(getattr(part, head), inner)
    return replace(part, **own) if own else part
