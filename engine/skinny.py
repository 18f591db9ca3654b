"""Linear layers for a few rows on CPU (decode steps): one GEMM with the weight on the left.

A decode step multiplies each weight by a handful of rows (one per running request), so it reads
every weight from memory once and is bound by memory bandwidth. `F.linear(x, w)` with 2-8 rows
goes to a GEMM that runs on one thread and reads at ~9 GB/s on the 2-core AVX2 machine this was
measured on, at 1 or 2 threads alike; `mm(w, x.T)` (same weight, same layout, no copy) reads at
~12.5 GB/s on one thread and ~22 GB/s on two. A single row takes the GEMV path either way
(~14 GB/s, one thread); on more than one thread it goes as two equal rows instead.

Measured with 60 different 576x1536 weights (212 MB, far more than the cache holds; SmolLM2's
MLP shape), ms per pass, F.linear / mm(w, x.T):

    rows        1          2          4          8          16
    1 thread    15.8/15.9  24.8/18.2  26.4/19.2  30.1/35.0  43.0/45.6
    2 threads   15.1/14.7  23.6/10.5  24.2/11.1  23.8/19.1  29.9/25.4

So: 2-4 rows always, up to 8 rows (and a single row, doubled) when torch runs more than one
thread. Not in deterministic mode (invariance.py owns every GEMM there) and not on GPUs.
The sums run in another order than F.linear's: logits differ in the last bits, as they do between
any two batch shapes in the default mode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def max_rows(threads: int) -> int:
    return 8 if threads > 1 else 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  threads: int | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as mm(weight, x.T) when x has few rows (CPU, float32)."""
    threads = threads or torch.get_num_threads()
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if (x.device.type != "cpu" or weight.dtype != torch.float32 or flat.dtype != torch.float32
            or weight.dim() != 2 or m > max_rows(threads) or m == 0 or (m == 1 and threads == 1)):
        return F.linear(x, weight, bias)
    rows = torch.cat([flat, flat]) if m == 1 else flat
    y = torch.mm(weight, rows.T).T[:m]
    if bias is not None:
        y = y + bias
    return y.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(TorchFunctionMode):
    """Every F.linear of a step with few rows goes through `skinny_linear`."""

    def __init__(self, threads: int):
        super().__init__()
        self.threads = threads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs["input"]
        w = args[1] if len(args) > 1 else kwargs["weight"]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        return skinny_linear(x, w, b, self.threads)
