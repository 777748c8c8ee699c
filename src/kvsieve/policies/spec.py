"""Policy specs: ``name[:key=value...]`` on the command line, and :class:`PolicySpec` for sweeps and benchmarks.

:func:`parse_policy_spec` reads the specs of ``kvsieve niah --policies`` and ``generate --policy``;
:class:`PolicySpec` is the hashable ``(name, parameters)`` a sweep cell or a benchmark run is keyed by,
read from a flag or a YAML entry (``kvsieve eval``, ``kvsieve bench``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml


def _value(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


#: Policy parameters the commands set from their own flags (``--budget``/``--budgets``), not from a spec.
FLAG_PARAMETERS = ("budget", "ratio")


def parse_policy_spec(spec: str, flag: str = "--policies") -> tuple[str, dict[str, object]]:
    """``"h2o_caote:schedule=blockwise:block_size=64"`` → ``("h2o_caote", {...})``.

    ``budget``/``ratio`` are refused in a spec: the command's ``--budget``/``--budgets`` set them, and a
    second value would be ambiguous.
    """
    name, *pairs = spec.split(":")
    if not name.strip():
        raise ValueError(f"{flag}: empty policy name in {spec!r}")
    params: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag}: expected name[:key=value...]; got {spec!r}")
        if key in FLAG_PARAMETERS:
            raise ValueError(f"{flag}: {spec!r} sets {key}; give budgets with --budget/--budgets, not in the "
                             "policy spec")
        if key in params:
            raise ValueError(f"{flag}: {spec!r} sets {key} twice")
        params[key] = _value(value)
    return name, params


class PolicySpecError(ValueError):
    """A policy entry of a sweep or benchmark is malformed (no name, ``key=value`` expected, a budget set)."""


def _scalar(text: str) -> Any:
    """``"8"`` → 8, ``"true"`` → True, ``"0.5"`` → 0.5, anything else stays a string (YAML's reading)."""
    value = yaml.safe_load(text)
    return value if isinstance(value, int | float | bool) or value is None else text


@dataclass(frozen=True)
class PolicySpec:
    """A policy name and its parameters other than the budget (sorted, hashable)."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, entry: str | Mapping[str, Any]) -> PolicySpec:
        """From ``"h2o:schedule=blockwise"`` or ``{"name": "h2o", "schedule": "blockwise"}``.

        Raises:
            PolicySpecError: no name, a parameter not written ``key=value``, or a ``budget`` parameter.
        """
        if isinstance(entry, Mapping):
            params = dict(entry)
            name = params.pop("name", None)
            if not isinstance(name, str):
                raise PolicySpecError(f"a policy entry needs a 'name'; got {dict(entry)!r}")
        else:
            name, *pairs = str(entry).strip().split(":")
            params = {}
            for pair in pairs:
                key, sep, value = pair.partition("=")
                if not sep or not key:
                    raise PolicySpecError(f"policy {entry!r}: parameters are written name:key=value")
                params[key.strip()] = _scalar(value.strip())
        if "budget" in params:
            raise PolicySpecError(f"policy {name!r}: give budgets with 'budgets', not as a policy parameter")
        return cls(name.strip(), tuple(sorted(params.items())))

    @property
    def params_dict(self) -> dict[str, Any]:
        """The parameters as a dict."""
        return dict(self.params)

    @property
    def params_key(self) -> str:
        """Canonical JSON of the parameters (part of a cell's identity)."""
        return json.dumps(self.params_dict, sort_keys=True)

    @property
    def label(self) -> str:
        """``h2o`` or ``h2o(schedule=blockwise)``: how tables and plots name it."""
        return label_of(self.name, self.params_dict)


def label_of(name: str, params: Mapping[str, Any] | None) -> str:
    """Display name of a policy with its parameters."""
    if not params:
        return name
    return f"{name}({','.join(f'{k}={v}' for k, v in sorted(params.items()))})"
