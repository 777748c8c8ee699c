"""Registry of policies by name: ``make_policy("snapkv", budget=256)``, ``list_policies()``."""

from __future__ import annotations

from typing import Any

from kvsieve.policies.base import Policy, PolicyConfigError

_REGISTRY: dict[str, type[Policy]] = {}


class UnknownPolicyError(ValueError):
    """Raised for a policy name that is not registered; the message lists the known ones."""


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator adding a policy under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    from kvsieve.policies import builtin  # noqa: F401  (imports every policy module once)


def policy_class(name: str) -> type[Policy]:
    _load_builtin()
    if name not in _REGISTRY:
        raise UnknownPolicyError(f"unknown policy {name!r}; known policies: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def make_policy(name: str, **params: Any) -> Policy:
    """Build a registered policy; unknown names and parameters raise before any work."""
    cls = policy_class(name)
    try:
        return cls(**params)
    except TypeError as err:
        from dataclasses import fields

        allowed = [f.name for f in fields(cls)]
        raise PolicyConfigError(f"{name}: {err}; allowed parameters: {allowed}") from None


def list_policies() -> dict[str, type[Policy]]:
    """Every registered policy class by name, sorted."""
    _load_builtin()
    return dict(sorted(_REGISTRY.items()))
