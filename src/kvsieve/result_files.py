"""Result files of long runs (``niah``, ``bench``): checked before any work, written atomically as they grow, and
naming the CPU they were measured on.

A run of minutes must not end in a traceback that loses its results: the output path is checked (a
writable file in a folder that exists or can be made) before the model loads, and the JSON is rewritten
after each finished piece of work, through a temporary file and ``os.replace``, so a crash or a full
disk leaves the previous complete version in place, never half a file.

Timings mean little without the machine: a CPU with bfloat16 matrix units (AMX, AVX512-BF16, Arm's BF16) runs a
bf16 model several times faster than float32, an AVX2-only one several times slower, and kvsieve's C passes take
different vector paths on AVX2 and AVX-512. :func:`cpu_info` is what every speed result records.
"""

from __future__ import annotations

import json
import os
import platform
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


#: CPU flags that mean bfloat16 matrix products are native (x86 AMX tiles, AVX512-BF16 dot products; Arm BF16).
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
#: Vector extensions that pick kvsieve's C paths (``kvsieve.native``): AVX2 + FMA, AVX-512, AMX tiles.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "amx_tile")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU a measurement ran on: ``model_name``, the ``bf16_flags`` present and whether bf16 is native
    (``bf16_native``), the ``vector_flags`` present (:data:`VECTOR_FLAGS`) and ``logical_cpus``.

    Read from ``/proc/cpuinfo`` (``cpuinfo`` replaces its text, for tests); without it (another OS) the model name
    is :func:`platform.processor` or the machine type and no flag is known (``bf16_native`` False).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    name, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and value.strip() and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:  # x86 "flags", Arm "Features": the first core's
            flags = set(value.split())
    bf16 = [flag for flag in BF16_FLAGS if flag in flags]
    return {
        "model_name": name or platform.processor() or platform.machine(),
        "bf16_flags": bf16,
        "bf16_native": bool(bf16),
        "vector_flags": [flag for flag in VECTOR_FLAGS if flag in flags],
        "logical_cpus": os.cpu_count(),
    }
