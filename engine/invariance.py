"""Batch-invariant linear layers for deterministic mode, calibrated on this machine.

A GEMM's kernel (and so its floating-point reduction order) depends on the number of rows M
and on the thread count: on this project's CPUs M=1 (a GEMV) and some small M gave other bits
for the same row than M=300, while every M >= 16 agreed. Deterministic mode needs a row's
result to be the same whatever M it was computed in (a decode batch of 1 or 4, a prefill
chunk of 16 or 256), so ``LinearPlan`` measures, once per engine, which row counts agree with a
large reference GEMM for every weight shape of the model, and pads any other M up to the next
row count that agrees. If some large M disagrees, it falls back to fixed 16-row tiles.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SMALL = range(1, 21)
LARGE = (24, 32, 48, 64, 100, 128, 200, 256)
REF_ROWS = 300
TILE = 16


@dataclass
class LinearPlan:
    pad_to: dict[int, int] = field(default_factory=dict)  # small M -> rows to compute
    tile: int | None = None  # when set, every GEMM runs in tiles of this many rows

    def rows_for(self, m: int) -> int:
        return self.pad_to.get(m, m)


def _agreeing_rows(w: torch.Tensor, ms, ref_rows: int) -> set[int]:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn((ref_rows, w.shape[1]), generator=g).to(device=w.device, dtype=w.dtype)
    ref = F.linear(x, w)
    return {m for m in ms if m <= ref_rows and torch.equal(F.linear(x[:m], w), ref[:m])}


@torch.inference_mode()
def calibrate(model, max_lm_rows: int = 16) -> LinearPlan:
    """Find the row counts whose GEMM rows agree with a large GEMM, for every Linear shape."""
    shapes: dict[tuple, torch.Tensor] = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod is not head:
            shapes.setdefault(tuple(mod.weight.shape), mod.weight)
    good = set(SMALL) | set(LARGE)
    for w in shapes.values():
        good &= _agreeing_rows(w, list(SMALL) + list(LARGE), REF_ROWS)
    if head is not None:  # the LM head only ever sees one row per running request
        head_ms = list(range(1, max_lm_rows + 1))
        good_head = _agreeing_rows(head.weight, head_ms, max(64, max_lm_rows))
        good &= good_head | {m for m in good if m > max_lm_rows}
    if not all(m in good for m in LARGE) or TILE not in good:
        return LinearPlan(tile=TILE)
    pad_to = {}
    for m in SMALL:
        if m not in good:
            pad_to[m] = min(g for g in good if g > m)
    return LinearPlan(pad_to=pad_to)


class BatchInvariantLinear(TorchFunctionMode):
    """Computes every F.linear with a row count from the calibrated plan."""

    def __init__(self, plan: LinearPlan):
        super().__init__()
        self.plan = plan

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        m = flat.shape[0]
        if self.plan.tile:
            t = self.plan.tile
            chunks = []
            for i in range(0, m, t):
                part = flat[i:i + t]
                n = part.shape[0]
                if n < t:
                    part = torch.cat([part, part.new_zeros((t - n, part.shape[1]))])
                chunks.append(func(part, *args[1:], **kwargs)[:n])
            y = torch.cat(chunks)
        else:
            rows = self.plan.rows_for(m)
            if rows == m:
                return func(*args, **kwargs)
            pad = flat.new_zeros((rows - m, flat.shape[1]))
            y = func(torch.cat([flat, pad]), *args[1:], **kwargs)[:m]
        return y.reshape(*x.shape[:-1], y.shape[-1])
