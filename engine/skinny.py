"""Linear layers for a few rows on CPU (decode steps): one GEMM with the weight on the left.

A decode step (or a short cached-prefix prefill) multiplies each weight by a handful of rows (one per running request), so it reads
every weight from memory once and is bound by memory bandwidth. `F.linear(x, w)` with 2-8 rows
goes to a GEMM that runs on one thread and reads at ~9 GB/s on the 2-core AVX2 machine this was
measured on, at 1 or 2 threads alike; `mm(w, x.T)` (same weight, same layout, no copy) reads at
~12.5 GB/s on one thread and ~22 GB/s on two. A single row takes the GEMV path either way
(~14 GB/s, one thread); on more than one thread it goes as two equal rows instead.

Measured with 60 different 576x1536 weights (212 MB, far more than the cache holds; SmolLM2's
MLP shape), ms per pass, F.linear / mm(w, x.T):

    rows        1          2          4          8          16         32         64
    1 thread    15.8/15.9  24.8/18.2  26.4/19.2  30.1/35.0  43.0/45.6  62.9/73.5  92.2/97.9
    2 threads   15.1/14.7  23.6/10.5  24.2/11.1  23.8/19.1  29.9/25.4  42.0/39.4  65.6/66.5

So: 2-4 rows on one thread; up to 8 rows (and a single row, doubled) when torch runs more than
one thread. Not more, although the table says 16 and 32 rows still gain: in the real model (a
20-token prefill of SmolLM2 after a cached system prompt, 2 threads) every Linear through
mm(w, x.T) made TTFT worse, 132 vs 126 ms; only the lm_head's few rows helped (105 ms). Not in deterministic mode (invariance.py owns every GEMM there) and not on GPUs.
The sums run in another order than F.linear's: logits differ in the last bits, as they do between
any two batch shapes in the default mode.
"""
from __future__ import annotations

import contextlib
import threading
import types

import torch
import torch.nn.functional as F


_step = threading.local()  # .threads: set while this thread runs a decode-sized step


def max_rows(threads: int) -> int:
    return 8 if threads > 1 else 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  threads: int | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as mm(weight, x.T) when x has few rows (CPU, float32)."""
    threads = threads or torch.get_num_threads()
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if (m > max_rows(threads) or m == 0 or (m == 1 and threads == 1) or x.dtype is not torch.float32
            or weight.dtype is not torch.float32 or x.device.type != "cpu" or weight.dim() != 2):
        return F.linear(x, weight, bias)
    flat = x.reshape(m, k)
    y = torch.mm(weight, (torch.cat([flat, flat]) if m == 1 else flat).T).T[:m]
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def decode_step(threads: int):
    """Within: the installed Linear layers of models run by this thread take `skinny_linear`."""
    _step.threads = threads
    try:
        yield
    finally:
        _step.threads = 0


def install(model: torch.nn.Module) -> None:
    """Give every plain nn.Linear of `model` a forward that takes `skinny_linear` inside
    `decode_step` on this thread, and is F.linear as before anywhere else (other engines, other
    threads, deterministic mode, transformers' own generate). Per module rather than a
    TorchFunctionMode, which costs a Python call for every op of the step."""
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and "forward" not in vars(mod):
            mod.forward = types.MethodType(_linear_forward, mod)


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    threads = getattr(_step, "threads", 0)
    if threads:
        return skinny_linear(x, self.weight, self.bias, threads)
    return F.linear(x, self.weight, self.bias)
