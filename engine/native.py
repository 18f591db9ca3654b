"""The engine's compiled kernel: paged attention for decode rows (csrc/decode_attention.c).

Written in C and built on first use with the host's C compiler (`cc`, or $CC), then cached in
the kvplay cache dir under a name that hashes the source, the flags and the CPU, so a later start
loads it at once (building takes about a second). It is loaded with ctypes (the call releases
the GIL) and runs on the OpenMP runtime torch already loaded (libgomp.so.1), so the process keeps
one thread pool.

Where it cannot be built (no compiler, a failed build, not float32, not CPU) or where
`KVPLAY_NATIVE=0`, `kernel()` is None and attention takes torch's ops (paged.py, cascade.py):
the same results to float32 rounding, slower at many decode rows.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .model import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict = {}  # "fn": the loaded function or None, once tried; "why": why not


def _cpu_id() -> str:
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


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_id().encode())
    return cache_root() / "native" / f"decode_attention-{key.hexdigest()[:16]}.so"


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if proc.returncode:
            raise RuntimeError((proc.stderr.strip().splitlines() or ["failed"])[-1])
        if not os.path.getsize(tmp):
            raise RuntimeError(f"{cc} wrote no library")
        os.replace(tmp, target)  # atomic: a concurrent start loads either none or a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load():
    if os.environ.get("KVPLAY_NATIVE", "1") == "0":
        return None, "KVPLAY_NATIVE=0"
    target = library_path()
    if not target.exists():
        cc = _compiler()
        if cc is None:
            return None, "no C compiler (cc) on PATH"
        try:
            _build(cc, target)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            return None, f"build failed: {e}"
    try:
        lib = ctypes.CDLL(str(target))
        fn = lib.kvplay_decode_attention
    except (OSError, AttributeError) as e:
        target.unlink(missing_ok=True)  # a damaged cache entry: the next start builds it again
        return None, f"load failed: {e}"
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, i64, i64, p, p, i64, p, i64, i64, p, p, p, p, i64, i32, i32, i32,
                   ctypes.c_float, i32]
    fn.restype = i32
    return fn, None


def kernel():
    """The decode-attention function, built and loaded once per process; None where it cannot
    be (`why_not()` says why, logged once)."""
    if "fn" not in _state:
        with _lock:
            if "fn" not in _state:
                fn, why = _load()
                if why is not None and why != "KVPLAY_NATIVE=0":
                    log.warning("decode attention kernel unavailable (%s); using torch ops", why)
                _state["why"] = why
                _state["fn"] = fn
    return _state["fn"]


def why_not() -> str | None:
    kernel()
    return _state["why"]


@dataclass
class DecodeRows:
    """One step's decode rows as the kernel reads them, built once a step: every row's key
    slots back to back, and per row (offset, length, query token)."""
    rows: list[int]  # the rows' indices in the step
    slots: torch.Tensor  # int64 [sum of lengths]
    meta: torch.Tensor  # int64 [3, rows]: offsets, lengths, query tokens

    @classmethod
    def of(cls, rows: list[int], row_slots: list[torch.Tensor], q_starts: list[int]) -> "DecodeRows":
        lens = [row_slots[r].shape[0] for r in rows]
        offs = [0] * len(rows)
        for j in range(1, len(rows)):
            offs[j] = offs[j - 1] + lens[j - 1]
        slots = torch.cat([row_slots[r] for r in rows]).contiguous()
        meta = torch.tensor([offs, lens, [q_starts[r] for r in rows]], dtype=torch.long)
        return cls(rows, slots, meta)


def decode_attention(fn, query: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor,
                     rows: DecodeRows, scaling: float | None, out: torch.Tensor, threads: int) -> bool:
    """The decode rows' attention into out [1, N, Hq, D]; query [1, Hq, N, D] (rows packed),
    kpool and vpool a layer's pool [Hkv, slots, D], all float32 on CPU. False (nothing to rely
    on written) when the layout is not one the kernel takes: the caller computes the rows."""
    hq, d, hk = query.shape[1], query.shape[3], kpool.shape[0]
    if (query.stride(3) != 1 or out.stride(3) != 1 or kpool.stride(2) != 1 or kpool.stride(1) != d
            or vpool.stride() != kpool.stride() or hq % hk):
        return False
    scale = scaling if scaling is not None else d ** -0.5
    meta = rows.meta
    rc = fn(query.data_ptr(), query.stride(2), query.stride(1), kpool.data_ptr(), vpool.data_ptr(),
            kpool.stride(0), out.data_ptr(), out.stride(1), out.stride(2), rows.slots.data_ptr(),
            meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), len(rows.rows), hq, hk, d,
            scale, threads)
    return rc == 0
