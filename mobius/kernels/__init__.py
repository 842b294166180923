"""Host kernels compiled on the machine that runs them: ``adamw_states.cpp`` (the bf16 and int8 optimizer states'
update, :mod:`mobius.states`), built once with the system's C++ compiler (``g++``, or ``$CXX``) for this CPU
(``-march=native``) and loaded through ctypes. The library is kept under ``$MOBIUS_KERNEL_DIR`` (default
``~/.cache/mobius/kernels``), named by a hash of its source, the flags, the compiler and this CPU's model and
features, so a home directory shared by machines of other CPUs keeps one per CPU. Where it cannot be built, one
line says so and the rules run as torch ops (the same numbers, slower).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("adamw_states.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC"]
BUILD_TIMEOUT_S = 300


def kernel_dir() -> Path:
    return Path(os.environ.get("MOBIUS_KERNEL_DIR") or Path.home() / ".cache" / "mobius" / "kernels")


def _cpu() -> str:
    """This CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() + platform.machine()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _build(cxx: str, out: Path) -> None:
    """Compile the source into ``out`` (atomically: ranks and tests that build at once each rename a whole file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def adamw_states() -> ctypes.CDLL | None:
    """The optimizer states' kernel, built here the first time; None where it cannot be (said once)."""
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler (%s): the bf16/int8 optimizer states update on the CPU with torch ops, "
                    "several times slower than their kernel", os.environ.get("CXX", "g++"))
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu()]).encode()).hexdigest()[:16]
        lib = kernel_dir() / f"adamw_states-{key}.so"
        if not lib.is_file():
            _build(cxx, lib)
        return _bind(ctypes.CDLL(str(lib)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        log.warning("the AdamW states kernel did not build with %s (%s): the bf16/int8 optimizer states update on "
                    "the CPU with torch ops, several times slower", cxx, detail[-1] if detail else type(e).__name__)
        return None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32 = ctypes.c_void_p, ctypes.c_int
    fn = lib.mobius_adamw_states
    fn.restype = i32
    fn.argtypes = [i32, i32, i32, p, p, p, p, p, p, p, p, p, p, ctypes.c_int64, ctypes.c_uint32]
    return lib
