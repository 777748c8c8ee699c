"""Preset files: a composition of parts saved as human-readable JSON (what ``kvsieve tune`` writes).

``KVCache(model, "tuned.json")``, :func:`kvsieve.make_policy` and every CLI ``--policy``/``--policies`` accept
the path of such a file wherever they accept a preset name. A file holds a base preset and the parameters
applied over it (part names and ``kind.field`` values, :func:`kvsieve.make_policy`'s rules), the budget it was
made for and, informational, where it came from::

    {
      "kvsieve_preset": 1,
      "name": "tuned_b64",
      "summary": "restkv scores, pyramid layer budgets, evict-then-merge",
      "base": "restkv",
      "params": {"allocator": "pyramid", "allocator.beta": 12, "action": "evict_merge", "action.tau": 0.8},
      "budget": 64,
      "provenance": {"model": "...", "kvsieve_version": "...", "calibration": {...}, "score": {...}}
    }

A caller's parameters win over the file's; its ``budget`` applies unless the caller gives a budget or a ratio.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvsieve.core.part import PolicyConfigError

#: Format version written in ``kvsieve_preset``.
PRESET_FORMAT = 1
_REQUIRED = ("kvsieve_preset", "name", "base", "params")


def is_preset_file(name: object) -> bool:
    """Whether a policy name is a path to a preset file (ends in ``.json``)."""
    return isinstance(name, str) and name.lower().endswith(".json")


def load_preset_document(path: str | Path) -> dict[str, Any]:
    """The file's JSON object, checked: format version, name, base preset, parameters (a flat object)."""
    file = Path(path)
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PolicyConfigError(f"policy: preset file {str(path)!r} does not exist") from None
    except (OSError, ValueError) as err:
        raise PolicyConfigError(f"policy: cannot read preset file {str(path)!r} ({err})") from None
    if not isinstance(document, dict) or any(key not in document for key in _REQUIRED):
        raise PolicyConfigError(f"policy: preset file {str(path)!r} must be a JSON object with keys {_REQUIRED}")
    if document["kvsieve_preset"] != PRESET_FORMAT:
        raise PolicyConfigError(f"policy: preset file {str(path)!r} has format {document['kvsieve_preset']!r}; "
                                f"this kvsieve reads format {PRESET_FORMAT}")
    name, base, params = document["name"], document["base"], document["params"]
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise PolicyConfigError(f"policy: preset file {str(path)!r}: name must be lower case letters, digits and _")
    if not isinstance(base, str) or is_preset_file(base):
        raise PolicyConfigError(f"policy: preset file {str(path)!r}: base must name a registered preset")
    if not isinstance(params, dict) or any(isinstance(v, dict | list) for v in params.values()):
        raise PolicyConfigError(f"policy: preset file {str(path)!r}: params must map names to plain values")
    budget = document.get("budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise PolicyConfigError(f"policy: preset file {str(path)!r}: budget must be an int ≥ 1 or null")
    return document


def read_preset_file(path: str | Path) -> tuple[str, str, dict[str, Any], int | None]:
    """``(name, base preset, parameters, budget)`` of a preset file."""
    document = load_preset_document(path)
    return document["name"], document["base"], dict(document["params"]), document.get("budget")


def write_preset_file(
    path: str | Path, name: str, base: str, params: dict[str, Any], budget: int | None, summary: str = "",
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Write a preset file (and check it reads back); returns its path."""
    document = {"kvsieve_preset": PRESET_FORMAT, "name": name, "summary": summary, "base": base,
                "params": dict(sorted(params.items())), "budget": budget, "provenance": provenance or {}}
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    load_preset_document(file)
    return file
