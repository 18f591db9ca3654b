"""Batch-invariant linear layers for deterministic mode: only measured GEMM shapes run.

A GEMM's kernel (and so its floating-point reduction order) depends on the number of rows M
and on the thread count: on this project's CPUs M=1 (a GEMV) and some small M gave other bits
for the same row than M=300. Deterministic mode needs a row's result to be the same whatever M
the step had (a decode batch of 1 or 4, a prefill of 16 or 2,000 packed tokens), so every
F.linear runs in **tiles** of a fixed row count T, and the last partial tile is padded up to a
**bucket** (a power of two <= T). For each weight shape, dtype, device and torch thread count,
``LinearPlan`` measures once, on first use, that

- the T-row GEMM gives each row the same bits wherever the row sits in it (rolled inputs give
  rolled outputs), else T is halved (down to 1: one row per GEMM, trivially invariant); and
- each bucket's rows equal the same rows of the T-row GEMM; a bucket that does not is skipped
  (its M is padded up to the next bucket that does).

So no row count runs that was not measured, whatever the batch. A new thread count (the app's
threads setting, ``--threads``) gets its own calibration.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .packed import packed_linear

TILE = 256  # rows per GEMM for layer weights (a prefill chunk's worth)
BIG_TILE = 64  # rows per GEMM for very wide weights (the LM head: one row per request)
BIG_WEIGHT = 1 << 24  # elements


@dataclass(frozen=True)
class ShapePlan:
    tile: int
    pad_to: tuple  # pad_to[m] = rows to compute for a tile of m rows (m = 1 .. tile)
    threads: int

    def pieces(self, m: int):
        """(start, rows, computed rows) covering m rows with measured shapes only."""
        t = self.tile
        for i in range(0, m, t):
            n = min(t, m - i)
            yield i, n, self.pad_to[n]


def _buckets(tile: int) -> list[int]:
    out, b = [], 1
    while b < tile:
        out.append(b)
        b *= 2
    return out + [tile]


def _gemm(w: torch.Tensor, packed: torch.Tensor | None):
    """The GEMM a tile runs: F.linear on the weight, or oneDNN on its packed copy (packed.py)."""
    if packed is None:
        return lambda x, b=None: F.linear(x, w, b)
    return lambda x, b=None: packed_linear(x, packed, b)


def calibrate_shape(w: torch.Tensor, threads: int, packed: torch.Tensor | None = None) -> ShapePlan:
    """Measure which row counts give the same per-row bits as a full tile, for weight w (its
    packed copy's GEMM when `packed` is given: each kernel is measured for itself)."""
    gemm = _gemm(w, packed)
    g = torch.Generator(device="cpu").manual_seed(0)
    tile = TILE if w.numel() < BIG_WEIGHT else BIG_TILE
    while tile > 1:
        x = torch.randn((tile, w.shape[1]), generator=g).to(device=w.device, dtype=w.dtype)
        ref = gemm(x)
        if all(torch.equal(gemm(x.roll(s, 0)), ref.roll(s, 0)) for s in (1, tile // 2 + 1)):
            break
        tile //= 2
    if tile == 1:
        return ShapePlan(1, (1, 1), threads)
    good = [m for m in _buckets(tile) if m == tile or torch.equal(gemm(x[:m]), ref[:m])]
    pad_to = [0] + [min(b for b in good if b >= m) for m in range(1, tile + 1)]
    return ShapePlan(tile, tuple(pad_to), threads)


@dataclass
class LinearPlan:
    """Calibrated shapes, keyed by (weight shape, dtype, device, torch threads)."""
    shapes: dict = field(default_factory=dict)

    def for_weight(self, w: torch.Tensor, packed: torch.Tensor | None = None) -> ShapePlan:
        threads = torch.get_num_threads()
        key = (tuple(w.shape), w.dtype, str(w.device), threads, packed is not None)
        plan = self.shapes.get(key)
        if plan is None:
            plan = self.shapes[key] = calibrate_shape(w.detach(), threads, packed)
        return plan


def tiled_linear(plan: LinearPlan, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed in the calibrated tiles and buckets of `weight`'s shape
    (on oneDNN's packed copy of the weight when `packed` is given, calibrated for that kernel)."""
    shape = plan.for_weight(weight, packed)
    gemm = _gemm(weight, packed)
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    parts = []
    for i, n, rows in shape.pieces(m):
        part = flat[i:i + n]
        if rows > n:
            part = torch.cat([part, part.new_zeros((rows - n, part.shape[1]))])
        parts.append(gemm(part, bias)[:n])
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class BatchInvariantLinear(TorchFunctionMode):
    """Computes every F.linear in calibrated tiles and buckets (see the module doc): for models
    run through transformers' modules (llama_step.py calls `tiled_linear` itself)."""

    def __init__(self, plan: LinearPlan):
        super().__init__()
        self.plan = plan

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x = args[0]
        w = args[1] if len(args) > 1 else kwargs["weight"]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        return tiled_linear(self.plan, x, w, b)
