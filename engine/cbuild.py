"""C sources built on first use with the host's C compiler (`cc`, or $CC), cached in the kvplay
cache dir under a name that hashes the sources, the flags and the CPU (`-march=native` depends on
it), so a later start loads the result at once. A build writes to a temporary file and renames it:
a concurrent start sees either no file or a whole one. Used for the engine's kernels (native.py,
loaded with ctypes) and the watch side's miss attribution (wire/miss_native.py, a CPython
extension).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from .model_spec import cache_root

BUILD_TIMEOUT_S = 120
OFF = "KVPLAY_NATIVE=0"  # why nothing is loaded when the user turned it off (not logged)


def cpu_id() -> str:
    """What -march=native depends on: the machine and the CPU's model and flags."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features")):
                    ident += line
                    if line.startswith(("flags", "Features")):
                        break
    except OSError:
        pass
    return ident


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cached_path(stem: str, files: list[Path], flags: list[str], suffix: str = ".so", extra: str = "") -> Path:
    """Where the build of `files` (sources and headers) with `flags` is cached."""
    key = hashlib.sha256(b"".join(f.read_bytes() for f in files) + " ".join(flags).encode()
                         + cpu_id().encode() + extra.encode())
    return cache_root() / "native" / f"{stem}-{key.hexdigest()[:16]}{suffix}"


def build(cc: str, sources: list[Path], flags: list[str], target: Path) -> None:
    """Compile `sources` with `flags` into `target`; RuntimeError with the compiler's last line
    when it fails (or writes nothing)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if proc.returncode:
            raise RuntimeError((proc.stderr.strip().splitlines() or ["failed"])[-1])
        if not os.path.getsize(tmp):
            raise RuntimeError(f"{cc} wrote no library")
        os.replace(tmp, target)  # atomic: a concurrent start loads either none or a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def built(stem: str, sources: list[Path], headers: list[Path], flags: list[str], suffix: str = ".so",
          extra: str = "") -> tuple[Path | None, str | None]:
    """(the cached build, None), building it first where it is not there; (None, why) where it
    cannot be built."""
    target = cached_path(stem, sources + headers, flags, suffix, extra)
    if not target.exists():
        cc = compiler()
        if cc is None:
            return None, "no C compiler (cc) on PATH"
        try:
            build(cc, sources, flags, target)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return None, f"build failed: {e}"
    return target, None


def load_once(state: dict, lock, load: Callable[[], tuple], log: logging.Logger, unavailable: str):
    """What `load()` -> (value or None, why not) gives, called once per process under `lock` and
    kept in `state` ("value", "why"); a reason other than `OFF` is logged once as `unavailable`
    (a format with one %s)."""
    if "value" not in state:
        with lock:
            if "value" not in state:
                value, why = load()
                if why is not None and why != OFF:
                    log.warning(unavailable, why)
                state["why"] = why
                state["value"] = value
    return state["value"]
