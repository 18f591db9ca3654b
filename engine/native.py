"""The engine's compiled kernels (csrc/), float32 on CPU:

- paged attention for decode rows (`decode_attention.c`): every decode row of a step in one call
  a layer, keys read in place from the pool;
- paged causal attention for prompt chunks (`prefill_attention.c`): every chunk's queries over
  the cached blocks before it and the chunk itself, in place; each query's result a function of
  its own keys only, so deterministic mode runs every row through it;
- the element-wise work around the GEMMs (`fused.c`): residual add + RMSNorm, SiLU x up, rotary
  with the K/V write into the pool, one pass each (llama_step.py).

Written in C and built on first use with the host's C compiler (`cc`, or $CC) into one library,
then cached in the kvplay cache dir under a name that hashes the sources, the flags and the CPU,
so a later start loads it at once (building takes a few seconds). It is loaded with ctypes (a
call releases the GIL) and runs on the OpenMP runtime torch already loaded (libgomp.so.1), so the
process keeps one thread pool.

Where it cannot be built (no compiler, a failed build, not float32, not CPU) or where
`KVPLAY_NATIVE=0`, `kernel()` is None and the engine takes torch's ops (paged.py, cascade.py,
llama_step.py): the same results to float32 rounding, slower.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cbuild

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "decode_attention.c", CSRC / "prefill_attention.c", CSRC / "fused.c"]
HEADERS = [CSRC / "vexp.h"]
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]

_lock = threading.Lock()
_state: dict = {}  # cbuild.load_once's: "value" (the kernels or None, once tried), "why" (why not)


def library_path() -> Path:
    return cbuild.cached_path("kvplay_kernels", SOURCES + HEADERS, FLAGS)


def _load():
    if os.environ.get("KVPLAY_NATIVE", "1") == "0":
        return None, cbuild.OFF
    target, why = cbuild.built("kvplay_kernels", SOURCES, HEADERS, FLAGS)
    if target is None:
        return None, why
    try:
        lib = ctypes.CDLL(str(target))
        fns = {name: getattr(lib, f"kvplay_{name}") for name in _SIGNATURES}
    except (OSError, AttributeError) as e:
        target.unlink(missing_ok=True)  # a damaged cache entry: the next start builds it again
        return None, f"load failed: {e}"
    for name, (restype, argtypes) in _SIGNATURES.items():
        fns[name].argtypes = argtypes
        fns[name].restype = restype
    return Kernels(**fns), None


_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "decode_attention": (_i32, [_p, _i64, _i64, _p, _p, _i64, _p, _i64, _i64, _p, _p, _p, _p, _i64,
                                _i32, _i32, _i32, _f32, _i32]),
    "prefill_attention": (_i32, [_p, _i64, _i64, _p, _p, _i64, _p, _i64, _i64, _p, _p, _p, _p, _p,
                                 _i64, _i32, _i32, _i32, _f32, _i32]),
    "rms_norm": (None, [_p, _i64, _p, _i64, _i64, _p, _f32, _p, _i32]),
    "silu_mul": (None, [_p, _i64, _i64, _p, _i32]),
    "rope_write": (None, [_p, _i64, _i64, _i32, _i32, _i32, _p, _p, _i64, _p, _p, _p, _i64, _p, _i32]),
}


@dataclass(frozen=True)
class Kernels:
    """The library's functions (ctypes, argument types set)."""
    decode_attention: object
    prefill_attention: object
    rms_norm: object
    silu_mul: object
    rope_write: object


def kernel() -> Kernels | None:
    """The compiled kernels, built and loaded once per process; None where they cannot be
    (`why_not()` says why, logged once)."""
    return cbuild.load_once(_state, _lock, _load, log, "compiled kernels unavailable (%s); using torch ops")


def why_not() -> str | None:
    kernel()
    return _state["why"]


@dataclass
class KernelRows:
    """Rows of one step as an attention kernel reads them, built once a step: every row's key
    slots back to back, and per row its offset there, its keys (past + new), its past and the
    step token of its first query."""
    rows: list[int]  # the rows' indices in the step
    slots: torch.Tensor  # int64 [sum of lengths]
    meta: torch.Tensor  # int64 [4, rows]: offsets, lengths, pasts, first query tokens
    ptrs: tuple = ()  # the data pointers of slots and of meta's four rows

    @classmethod
    def of(cls, rows: list[int], row_slots: list[torch.Tensor], q_starts: list[int],
           past_lens: list[int]) -> "KernelRows":
        lens = [row_slots[r].shape[0] for r in rows]
        offs = [0] * len(rows)
        for j in range(1, len(rows)):
            offs[j] = offs[j - 1] + lens[j - 1]
        slots = torch.cat([row_slots[r] for r in rows]).contiguous()
        meta = torch.tensor([offs, lens, [past_lens[r] for r in rows], [q_starts[r] for r in rows]],
                            dtype=torch.long)
        return cls(rows, slots, meta, (slots.data_ptr(), *(meta[i].data_ptr() for i in range(4))))


def _takes(query: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, out: torch.Tensor) -> bool:
    hq, d, hk = query.shape[1], query.shape[3], kpool.shape[0]
    return (query.stride(3) == 1 and out.stride(3) == 1 and kpool.stride(2) == 1 and kpool.stride(1) == d
            and vpool.stride() == kpool.stride() and hq % hk == 0 and query.dtype is torch.float32
            and kpool.dtype is torch.float32 and vpool.dtype is torch.float32 and out.dtype is torch.float32)


def decode_attention(lib: Kernels, query: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor,
                     rows: KernelRows, scaling: float | None, out: torch.Tensor, threads: int) -> bool:
    """The decode rows' attention into out [1, N, Hq, D]; query [1, Hq, N, D] (rows packed),
    kpool and vpool a layer's pool [Hkv, slots, D], all float32 on CPU. False (nothing to rely
    on written) when the layout is not one the kernel takes: the caller computes the rows."""
    if not _takes(query, kpool, vpool, out):
        return False
    hq, d, hk = query.shape[1], query.shape[3], kpool.shape[0]
    scale = scaling if scaling is not None else d ** -0.5
    slots, offs, lens, _, toks = rows.ptrs
    rc = lib.decode_attention(query.data_ptr(), query.stride(2), query.stride(1), kpool.data_ptr(),
                              vpool.data_ptr(), kpool.stride(0), out.data_ptr(), out.stride(1), out.stride(2),
                              slots, offs, lens, toks, len(rows.rows), hq, hk, d, scale, threads)
    return rc == 0


def prefill_attention(lib: Kernels, query: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor,
                      rows: KernelRows, scaling: float | None, out: torch.Tensor, threads: int) -> bool:
    """The rows' causal attention (query i of a row at position past + i sees keys 0 .. past + i)
    into out [1, N, Hq, D]; the arguments as for `decode_attention`. Any row with new tokens,
    one or many. False when the layout is not one the kernel takes."""
    if not _takes(query, kpool, vpool, out):
        return False
    hq, d, hk = query.shape[1], query.shape[3], kpool.shape[0]
    scale = scaling if scaling is not None else d ** -0.5
    slots, offs, lens, pasts, toks = rows.ptrs
    rc = lib.prefill_attention(query.data_ptr(), query.stride(2), query.stride(1), kpool.data_ptr(),
                               vpool.data_ptr(), kpool.stride(0), out.data_ptr(), out.stride(1), out.stride(2),
                               slots, offs, lens, pasts, toks, len(rows.rows), hq, hk, d, scale, threads)
    return rc == 0


def rms_norm(lib: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [N, H] (rows may be strided) times weight; with `delta` [N, H] (contiguous)
    first x += delta, in place (the residual stream). float32 CPU tensors."""
    n, h = x.shape
    out = torch.empty((n, h), dtype=x.dtype)
    lib.rms_norm(x.data_ptr(), x.stride(0), 0 if delta is None else delta.data_ptr(), n, h,
                 weight.data_ptr(), eps, out.data_ptr(), threads)
    return out


def silu_mul(lib: Kernels, gate_up: torch.Tensor, threads: int) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2I] (contiguous: gate the first I columns): [N, I]."""
    n, two = gate_up.shape
    out = torch.empty((n, two // 2), dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), n, two // 2, out.data_ptr(), threads)
    return out


def rope_write(lib: Kernels, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, cos: torch.Tensor,
               sin: torch.Tensor, slots: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor,
               threads: int) -> torch.Tensor:
    """qkv [N, (heads + 2 kv_heads) dim] (rows contiguous): rotary (cos, sin [N, dim]) on q and
    k; k and v written into the pool [Hkv, slots, dim] at `slots` [N]; returns q [N, heads, dim]."""
    n = qkv.shape[0]
    q = torch.empty((n, heads, dim), dtype=qkv.dtype)
    lib.rope_write(qkv.data_ptr(), n, qkv.stride(0), heads, kv_heads, dim, cos.data_ptr(), sin.data_ptr(),
                   cos.stride(0), slots.data_ptr(), kpool.data_ptr(), vpool.data_ptr(), kpool.stride(0),
                   q.data_ptr(), threads)
    return q
