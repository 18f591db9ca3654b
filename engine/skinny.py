"""Linear layers for a few rows on CPU (decode steps, short prefills): one GEMM with the weight
on the left.

A decode step (or a short cached-prefix prefill) multiplies each weight by a handful of rows (one
per running request), so it reads every weight from memory once and is bound by memory
bandwidth. `F.linear(x, w)` with 2-8 rows goes to a GEMM that runs on one thread and reads at
~9 GB/s on the 2-core AVX2 machine this was measured on, at 1 or 2 threads alike;
`mm(w, x.T)` (same weight, same layout, no copy) reads at ~12.5 GB/s on one thread and ~22 GB/s
on two. A single row takes the GEMV path either way (~14 GB/s, one thread); on more than one
thread it goes as two equal rows instead.

Measured with 60 different 576x1536 weights (212 MB, far more than the cache holds; SmolLM2's
MLP shape), ms per pass, F.linear / mm(w, x.T):

    rows        1          2          4          8          16         32         64
    1 thread    15.8/15.9  24.8/18.2  26.4/19.2  30.1/35.0  43.0/45.6  62.9/73.5  92.2/97.9
    2 threads   15.1/14.7  23.6/10.5  24.2/11.1  23.8/19.1  29.9/25.4  42.0/39.4  65.6/66.5

Beyond 8 rows, on 2 threads, `mm(w, x.T)` is fast only for multiples of 16 rows: SmolLM2's 120
layer GEMMs (fused q/k/v and gate/up, as llama_step.py runs them), ms, F.linear / mm(w, x.T):

    rows        9          16         26         32         48         64         128        256
    2 threads   58.9/40.4  52.5/38.8  66.4/73.6  73.1/57.7  92.7/76.1  112.4/94.5 192.8/165.9 335.3/315.3

so `skinny_mm` pads more than 8 rows up to a multiple of 16 (zero rows): every size up to 256
then gains. On 1 thread 16-128 rows are level (77.8/75.3 at 16, 336.4/330.5 at 128) and 8 lose.

Who uses what: the decoder written out (llama_step.py) takes `mm(w, x.T)` for up to
`written_out_rows` rows, and its outputs stay [m, n] views of the product; transformers' modules
(`install`, for models llama_step.py does not take) copy every output back to row-major, which
made 9-32 rows slower there (a 20-token prefill, 132 vs 126 ms), so they stop at `max_rows`, as
the lm_head does. Not in deterministic mode (invariance.py owns every GEMM there) and not on
GPUs. The sums run in another order than F.linear's: logits differ in the last bits, as they do
between any two batch shapes in the default mode.
"""
from __future__ import annotations

import contextlib
import threading
import types

import torch
import torch.nn.functional as F


_step = threading.local()  # .threads: set while this thread runs a decode-sized step


def max_rows(threads: int) -> int:
    """Most rows a Linear module (or the lm_head) takes through `skinny_linear`."""
    return 8 if threads > 1 else 4


def written_out_rows(threads: int) -> int:
    """Most rows llama_step.py takes through `skinny_mm`."""
    return 256 if threads > 1 else 4


def skinny_mm(x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
    """x [m, k] @ weight.T as mm(weight, x.T): a [m, n] view of the [n, m] product (not
    contiguous unless m is 1). One row on one thread is F.linear's GEMV; on more threads it goes
    as two equal rows; more than 8 rows are padded to a multiple of 16 (see the module doc)."""
    m = x.shape[0]
    if m == 1 and threads == 1:
        return F.linear(x, weight)
    if m == 1:
        x = torch.cat([x, x])
    elif m > 8 and m % 16:
        x = torch.cat([x, x.new_zeros((16 - m % 16, x.shape[1]))])
    else:  # x row-major, so x.T reaches MKL as a transposed operand: a column-major x.T (the
        x = x.contiguous()  # view an earlier skinny_mm returns) took 4x as long for 4 rows
    return torch.mm(weight, x.T).T[:m]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  threads: int | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as mm(weight, x.T) when x has few rows (CPU, float32)."""
    threads = threads or torch.get_num_threads()
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if (m > max_rows(threads) or m == 0 or (m == 1 and threads == 1) or x.dtype is not torch.float32
            or weight.dtype is not torch.float32 or x.device.type != "cpu" or weight.dim() != 2):
        return F.linear(x, weight, bias)
    y = skinny_mm(x.reshape(m, k), weight, threads)
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
