"""The parts a policy composes: scorers, allocators, actions, selectors and schedules — one file per method.

Each part class registers itself when its file is imported (``Part.__init_subclass__``) and each method
file ends with its presets; :mod:`kvsieve.policies.catalog` discovers both, so no list here names them.
For convenience ``from kvsieve.parts import WindowAttention`` finds a name defined in any module of this
package (imported on first use).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    for module in pkgutil.walk_packages(__path__, f"{__name__}."):
        loaded = importlib.import_module(module.name)
        value = loaded.__dict__.get(name)
        if value is not None and getattr(value, "__module__", module.name) == module.name:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (no module of kvsieve.parts defines it)")
