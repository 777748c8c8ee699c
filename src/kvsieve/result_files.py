"""Result files of long runs (``niah``, ``bench``): checked before any work, written atomically as they grow.

A run of minutes must not end in a traceback that loses its results: the output path is checked (a
writable file in a folder that exists or can be made) before the model loads, and the JSON is rewritten
after each finished piece of work, through a temporary file and ``os.replace``, so a crash or a full
disk leaves the previous complete version in place, never half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """kvsieve's cache folder: ``cache_dir``, else ``$KVSIEVE_CACHE``, else ``$XDG_CACHE_HOME/kvsieve``,
    else ``~/.cache/kvsieve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("KVSIEVE_CACHE"):
        return Path(os.environ["KVSIEVE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvsieve"


def check_output_file(path: str | Path, parameter: str = "--output") -> Path:
    """Make ``path``'s folder and check a file can be written there; ``ValueError`` naming ``parameter``."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{parameter}: {out} is a folder; pass a file path such as {out / 'results.json'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{parameter}: cannot create the folder {out.parent} ({err.strerror or err})") from None
    try:
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".check"):
            pass
    except OSError as err:
        raise ValueError(f"{parameter}: cannot write in {out.parent} ({err.strerror or err})") from None
    if out.exists() and not os.access(out, os.W_OK):
        raise ValueError(f"{parameter}: {out} exists and is not writable")
    return out


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write ``payload`` as JSON to ``path`` through a temporary file in the same folder and ``os.replace``."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
            fh.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
