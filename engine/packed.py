"""Weights prepacked once for oneDNN, for the CPU GEMMs of the decoder written out (llama_step.py).

`F.linear(x, w)` hands MKL the weight in PyTorch's row-major layout on every call, and a GEMM of
a few rows re-packs panels of it each time. oneDNN's matmul reads its own blocked layout; the
weights reordered into it once (`torch.ops.mkldnn._reorder_linear_weight`, as vLLM's CPU backend
builds `create_onednn_mm` handlers and torch's inductor uses `_linear_pointwise`) make a step of
several rows — a serving step: several users' decode rows and a prompt chunk — much cheaper.
`scripts/step_paths.py` measures it on the embedded model; at one thread, thread CPU time, best
of 5, on the 2-core AVX2 machine while other jobs shared it (load 4): 8 decode rows 130 → 83 ms,
8 decode rows + a 48-token chunk 284 → 213 ms, 32 decode rows 312 → 231 ms; one row was level
there. On the AVX-512 EPYC (2026-12-04) one row is faster packed too (a one-row forward 53 → 46–48
ms at one thread: F.linear's GEMV read the weights at ~10 GB/s, oneDNN's packed kernel at ~15),
so the packed weights now serve one row on one thread as well, the lm_head included.

The packed copy is oneDNN's own (opaque) tensor beside the weight, which the module path and
transformers' forward still read: the weights are held twice (measured
for SmolLM2-135M: +0.76 GB RSS, its parameters being 0.5 GB). `--no-packed-weights`
(EngineConfig.packed_weights) turns it off. The sums run in oneDNN's order: logits differ
from F.linear's in the last bits, as they do
between any two batch shapes in the default mode. Deterministic mode runs its calibrated tiles
(invariance.py) on this kernel too, measuring its row counts for it.
"""
from __future__ import annotations

import torch


# Below this many elements a oneDNN call's fixed cost outweighs what packing saves (the tiny test
# models, hidden size 64: 3 decode rows 0.87 ms a step plain, 1.09 ms packed).
MIN_ELEMENTS = 1 << 16


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype is torch.float32 and weight.dim() == 2
            and weight.numel() >= MIN_ELEMENTS and torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [out, in] float32 CPU weight, or None where it cannot be made."""
    if not can_pack(weight):
        return None
    done = getattr(weight, "_kvplay_packed", None)
    if done is not None:  # a second runner on the same model shares the first one's copy
        return done
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except (RuntimeError, AttributeError):  # a torch built without oneDNN's linear ops
        return None
    weight._kvplay_packed = packed
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [m, in], with the weight as `pack` made it."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
