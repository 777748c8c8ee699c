"""Build and load kvsieve's C helpers (``*.c`` beside this file) on first use, cached per source and machine.

Nothing is built at import. The first call of :func:`load` compiles the source with the system's C compiler
(``$CC``, else ``cc``; flags: :data:`BASE_FLAGS`, then the first set of :data:`OPTIONAL_FLAGS` it accepts) into
kvsieve's cache folder (:func:`kvsieve.result_files.cache_root`, ``native/``), under a name that hashes the source,
the compiler's version, the flags and the CPU (``-march=native`` code must not run on another CPU that shares the
folder), through a temporary file and ``os.replace`` (two processes building at once both end with a whole
library). Later processes load the cached file (~1 ms).

Where it cannot be built — no compiler, a compiler without ``_Float16``, Windows, ``KVSIEVE_NATIVE=0`` — :func:`load`
returns None once, logs why at INFO, and every caller keeps its PyTorch path. The helpers read raw CPU memory
through ``ctypes``; their callers check every tensor (device, dtype, contiguity, shapes) first.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvsieve.result_files import cache_root

LOG = logging.getLogger("kvsieve.native")

#: Flags of every build, then the optional ones tried in this order (the first set the compiler accepts is kept):
#: ``-march=native`` (the vector loops need AVX2, FMA and F16C) and ``-fopenmp``. An OpenMP build links
#: ``libgomp.so.1`` by its soname, which torch's own ``libgomp.so.1`` (loaded first, with torch) answers: the helpers'
#: parallel loops run on torch's OpenMP threads, at ``torch.get_num_threads()``, instead of competing with them.
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")
OPTIONAL_FLAGS = (("-march=native", "-fopenmp"), ("-march=native",), ("-fopenmp",), ())
#: Libraries linked after the source (``expf``).
LIBRARIES = ("-lm",)
#: The C argument types the helpers' signatures are written in (``int``, ``int64_t``, a pointer, ``float``).
I32, I64, PTR, F32, F64 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_double

#: The ABI number the C source returns from ``kvsieve_native_abi`` (a stale cached build is not used).
ABI = 1


def enabled() -> bool:
    """False when ``KVSIEVE_NATIVE`` is ``0``/``false``/``no``/``off`` (read at the first :func:`load`)."""
    return os.environ.get("KVSIEVE_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``<name>.c`` beside this module, or None where it cannot be built (module docstring).
    Cached for the process: a failed build is not retried."""
    if not enabled():
        LOG.info("kvsieve.native: disabled by KVSIEVE_NATIVE; using the PyTorch paths")
        return None
    if os.name == "nt":
        LOG.info("kvsieve.native: not built on Windows; using the PyTorch paths")
        return None
    try:
        path = _built(Path(__file__).with_name(f"{name}.c"))
        library = ctypes.CDLL(str(path))
        if library.kvsieve_native_abi() != ABI:
            raise OSError(f"{path} reports ABI {library.kvsieve_native_abi()}, expected {ABI}")
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        LOG.info("kvsieve.native: %s.c not built (%s); using the PyTorch path", name, err)
        return None
    return library


@functools.cache
def function(name: str, symbol: str, argtypes: tuple[type, ...], restype: type = ctypes.c_int
             ) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``symbol`` of the library :func:`load` builds from ``<name>.c``, with its argument and result types set; None
    where the library is not built. Cached: each helper's wrapper binds its C function here once."""
    library = load(name)
    if library is None:
        return None
    bound = getattr(library, symbol)
    bound.argtypes = list(argtypes)
    bound.restype = restype
    return bound



def vector_code(name: str = "tiers") -> bool:
    """Whether the library built from ``<name>.c`` has its vector code (AVX2, FMA, F16C: the attention passes run);
    False where it is not built or the CPU lacks them (an ARM CPU, an x86 one before Haswell)."""
    probe = function(name, "kvsieve_vector_code", ())
    return probe is not None and bool(probe())

def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise OSError("no C compiler (set CC or install gcc/clang)")
    return compiler


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for), as far as the system says."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = [line for line in text.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def _built(source: Path) -> Path:
    """The compiled library of ``source`` in the cache folder, compiling it first if it is not there."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    attempts = [(*BASE_FLAGS, *optional) for optional in OPTIONAL_FLAGS]
    folder = cache_root() / "native"
    errors = []
    for flags in attempts:
        digest = hashlib.sha256("\0".join([source.read_text(encoding="utf-8"), compiler, version, *flags, *LIBRARIES,
                                           platform.machine(), _cpu_signature()]).encode()).hexdigest()[:20]
        target = folder / f"{source.stem}-{digest}.so"
        if target.exists():
            return target
        folder.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            result = subprocess.run([compiler, *flags, str(source), "-o", temporary, *LIBRARIES],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                os.replace(temporary, target)
                return target
            message = result.stderr.strip()
            errors.append(message.splitlines()[-1] if message else f"exit {result.returncode}")
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    raise OSError(f"{compiler} failed: {'; '.join(errors)}")
