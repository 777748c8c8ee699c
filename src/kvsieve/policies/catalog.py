"""What kvsieve knows by name: every part and every preset, discovered, not listed.

:func:`discover` imports each module of :mod:`kvsieve.parts` once; importing a part's file registers its
classes (``Part.__init_subclass__``) and its module-level ``PRESETS`` tuple is recorded here. A method
is therefore one file: nothing else names it. Code outside kvsieve registers its own presets with
:func:`register_preset` (its part classes register themselves when defined).
"""

from __future__ import annotations

import importlib
import pkgutil

import kvsieve.parts
from kvsieve.core.part import PART_KINDS, Part, PolicyConfigError, registered_parts
from kvsieve.core.preset import Preset

#: The reference: no part, every entry kept.
FULL = Preset("full", "everything (reference; no compression)")

_presets: dict[str, Preset] = {}
_discovered = False
_builtin: list[Preset] = []


class UnknownPolicyError(ValueError):
    """Raised for a policy name that is not registered; the message lists the known ones."""


def discover() -> None:
    """Import every module of :mod:`kvsieve.parts` (once) and record the presets they define."""
    global _discovered
    if _discovered:
        return
    found: list[Preset] = [FULL]
    for module in pkgutil.walk_packages(kvsieve.parts.__path__, "kvsieve.parts."):
        loaded = importlib.import_module(module.name)
        found += list(getattr(loaded, "PRESETS", ()))
    for preset in found:
        _add(preset, replace=False)
    _builtin.extend(found)
    _discovered = True


def _add(preset: Preset, *, replace: bool) -> None:
    if not isinstance(preset, Preset):
        raise PolicyConfigError(f"preset must be a Preset; got {preset!r}")
    known = _presets.get(preset.name)
    if known is not None and known != preset and not replace:
        raise PolicyConfigError(f"a preset named {preset.name!r} exists already; pass replace=True to replace it")
    _presets[preset.name] = preset


def register_preset(preset: Preset, *, replace: bool = False) -> Preset:
    """Make ``preset`` available by name (``KVCache(model, preset.name)``, ``kvsieve list``); returns it."""
    discover()
    _add(preset, replace=replace)
    return preset


def unregister_preset(name: str) -> None:
    """Forget a preset added with :func:`register_preset` (the built-in presets stay)."""
    discover()
    if name == FULL.name or any(name == p.name for p in _builtin):
        raise PolicyConfigError(f"{name!r} is a built-in preset and cannot be removed")
    _presets.pop(name, None)


def presets() -> dict[str, Preset]:
    """Every preset by name, sorted."""
    discover()
    return dict(sorted(_presets.items()))


def preset(name: str) -> Preset:
    """The preset called ``name``; :class:`UnknownPolicyError` lists the known ones."""
    known = presets()
    if name not in known:
        raise UnknownPolicyError(f"unknown policy {name!r}; known policies: {sorted(known)}")
    return known[name]


def parts(kind: str) -> dict[str, type[Part]]:
    """Every part class of ``kind`` (one of :data:`~kvsieve.core.part.PART_KINDS`) by name, sorted."""
    discover()
    return dict(sorted(registered_parts(kind).items()))


def part_named(kind: str, name: str) -> Part:
    """A part of ``kind`` by name, with its defaults; a scorer may also be named by a preset (its scorer,
    with that preset's settings: ``scorer="h2o_caote"`` is CAOTE over H2O)."""
    if kind not in PART_KINDS:
        raise PolicyConfigError(f"kind must be one of {PART_KINDS}; got {kind!r}")
    if kind == "scorer" and name in presets():
        scorer = presets()[name].scorer
        if scorer is None:
            raise PolicyConfigError(f"preset {name!r} has no scorer (it keeps every entry); choose a scoring "
                                    f"preset or one of the scorers {sorted(parts('scorer'))}")
        return scorer
    table = parts(kind)
    if name not in table:
        extra = " or a scoring preset's name" if kind == "scorer" else ""
        raise PolicyConfigError(f"{kind} must be one of {sorted(table)}{extra}, or a part object; got {name!r}")
    return table[name]()
