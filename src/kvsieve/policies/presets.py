"""Named methods as presets of parts: ``make_policy("adakv", budget=256)``, ``list_policies()``.

The presets themselves live at the end of each method's file in :mod:`kvsieve.parts` and are discovered
(:mod:`kvsieve.policies.catalog`). :func:`make_policy` builds one with the caller's parameters, by one rule
for every method:

1. ``budget``, ``ratio``, ``expand_gqa`` and ``fuse_statistics`` belong to the policy;
2. a part kind (``scorer``, ``allocator``, ``action``, ``selector``, ``schedule``, or a preset's alias of
   one, such as ``adakv``'s ``base``) replaces that part: a registered name, a scoring preset's name (for
   ``scorer``) or a part object;
3. every other parameter goes to the part that declares a field (or an alias) of that name — nested parts
   included (CAOTE's base) — the first in ``scorer, allocator, action, selector, schedule`` order unless the
   preset routes it (``routes``) or the name says the part: ``allocator.beta=10`` is the allocator's ``beta``
   whatever the scorer declares (how ``kvsieve tune`` writes its compositions); fields a part takes from the
   budget (a selector's ``k``) are not parameters;
4. each part is rebuilt once and validates itself, then the :class:`Policy` checks the combination.

Unknown names and parameters raise before any work, listing what is allowed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvsieve.core.part import PART_KINDS, Part, PolicyConfigError
from kvsieve.core.preset import POLICY_PARAMS, SCHEDULE_PARAMS, Preset, routable_fields, with_fields
from kvsieve.policies.catalog import (
    FULL,
    UnknownPolicyError,
    part_named,
    parts,
    preset,
    presets,
    register_preset,
    unregister_preset,
)
from kvsieve.policies.policy import Policy
from kvsieve.policies.preset_file import is_preset_file, read_preset_file

__all__ = ["FULL", "Preset", "UnknownPolicyError", "list_policies", "make_policy", "preset", "register_preset",
           "unregister_preset"]


def list_policies() -> dict[str, Preset]:
    """Every registered preset by name, sorted."""
    return presets()


def _replacement(name: str, kind: str, given: str, value: object, built: dict[str, Part | None]) -> Part | None:
    """The part ``value`` names for ``kind`` (passed as parameter ``given``)."""
    if isinstance(value, Part):
        if value.kind != kind:
            raise PolicyConfigError(f"{name}: {given} must be a {kind}; got the {value.kind} {value}")
        return value
    if value is None and kind == "selector":
        return None
    if isinstance(value, str):
        current = built.get(kind)
        if current is not None and current.name == value:
            return current  # naming the part the preset has keeps the preset's settings (trimkv's buffer)
        if kind == "scorer" and value not in presets() and value not in parts("scorer"):
            raise UnknownPolicyError(f"{name}: {given}: unknown scorer or scoring preset {value!r}; known scorers: "
                                     f"{sorted(parts('scorer'))}; scoring presets: "
                                     f"{sorted(n for n, p in presets().items() if p.scorer is not None)}")
        try:
            return part_named(kind, value)
        except PolicyConfigError as err:
            raise PolicyConfigError(f"{name}: {given}: {err}") from None
    raise PolicyConfigError(f"{name}: {given} must be a name or a {kind} object; got {value!r}")


def _owner(param: str, p: Preset, built: dict[str, Part | None]) -> tuple[str, tuple[str, ...]] | None:
    """(part kind, field path) that parameter ``param`` (or ``kind.param``) sets, or None."""
    kind_given, dot, field_name = param.partition(".")
    if dot:
        order, param = ([kind_given] if kind_given in PART_KINDS else []), field_name
    else:
        order = [p.routes[param]] if param in p.routes else list(PART_KINDS)
    for kind in order:
        part = built[kind]
        if part is not None:
            path = routable_fields(part).get(param)
            if path is not None:
                return kind, path
    return None


def make_policy(name: str, **params: Any) -> Policy:
    """Build a preset with ``params`` (see the module docstring); bad names and values raise before any work.

    ``name`` may also be a preset file (``*.json``, :mod:`kvsieve.policies.preset_file`, e.g. written by
    ``kvsieve tune``): its base preset and parameters, then ``params`` over them.
    """
    if is_preset_file(name):
        file_name, base, stored, budget = read_preset_file(name)
        if budget is not None and "budget" not in params and "ratio" not in params:
            params["budget"] = budget
        return replace(make_policy(base, **{**stored, **params}), name=file_name)
    p = preset(name)
    built: dict[str, Part | None] = p.parts()
    policy_kw = {key: params.pop(key) for key in POLICY_PARAMS if key in params}
    for given in [key for key in params if key in PART_KINDS or key in p.aliases]:
        kind = p.aliases.get(given, given)
        built[kind] = _replacement(name, kind, given, params.pop(given), built)
    changes: dict[str, dict[tuple[str, ...], Any]] = {kind: {} for kind in PART_KINDS}
    given_as: dict[tuple[str, str], str] = {}
    for param, value in params.items():
        owner = _owner(param, p, built)
        if owner is None:
            raise PolicyConfigError(_unexpected(name, param, p, built))
        changes[owner[0]][owner[1]] = value
        given_as[(owner[0], owner[1][-1])] = param
    for kind in PART_KINDS:
        part = built[kind]
        if part is None:
            continue
        if part.budget_fields:
            if policy_kw.get("budget") is None:
                raise PolicyConfigError(f"{name}: needs budget (int ≥ 1): the number of entries each query "
                                        "attends to")
            changes[kind].update({(f,): policy_kw["budget"] for f in part.budget_fields})
        try:
            built[kind] = with_fields(part, changes[kind])
        except PolicyConfigError as err:
            names = [given_as[(kind, path[-1])] for path in changes[kind] if (kind, path[-1]) in given_as]
            aliased = [n for n, path in zip(names, changes[kind], strict=False) if n != path[-1]]
            prefix = f"{name}: {', '.join(aliased)}: " if aliased else f"{name}: "
            raise PolicyConfigError(prefix + str(err)) from None
        except TypeError as err:  # a field of another part class than the one given as an object
            raise PolicyConfigError(f"{name}: {err}") from None
    return Policy(name=name, **{k: v for k, v in built.items() if v is not None}, **policy_kw)


def _unexpected(name: str, param: str, p: Preset, built: dict[str, Part | None]) -> str:
    if param in SCHEDULE_PARAMS:
        schedule = built["schedule"]
        current = schedule.name if schedule is not None else "prefill"
        takers = sorted(n for n, cls in parts("schedule").items() if param in routable_fields(cls()))
        return (f"{name}: {param} belongs to the {' and '.join(takers)} schedules; this policy's schedule is "
                f"{current!r}: pass schedule={takers[0]!r} with it")
    allowed = p.parameters(**{k: v for k, v in built.items() if v is not getattr(p, k)})
    return f"{name}: unexpected parameter {param!r}; allowed parameters: {allowed}"

