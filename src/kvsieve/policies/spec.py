"""Policy specs on the command line: ``name[:key=value...]`` (``kvsieve niah --policies``, ``generate --policy``)."""

from __future__ import annotations


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
