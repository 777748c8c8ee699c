"""Data shipped inside installed packages (the default model, the haystack essays), found without importing them."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_roots(package: str, what: str, pip_hint: str) -> list[Path]:
    """The folders of the installed ``package`` (its ``__init__`` is not run).

    Raises:
        ModuleNotFoundError: the package is not installed; the message says ``what`` it ships and the pip command.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{what} come from the '{package.replace('_', '-')}' package, which is not "
                                  f"installed. Install it with: {pip_hint}")
    return [Path(root) for root in spec.submodule_search_locations]
