"""Weights prepacked once for oneDNN, for the CPU GEMMs of the decoder written out (llama_step.py).

`F.linear(x, w)` hands MKL the weight in PyTorch's row-major layout on every call, and a GEMM of
a few rows re-packs panels of it each time: on the 2-core AVX2 machine kvplay is measured on, the
120 layer GEMMs of SmolLM2-135M at one thread took 65 ms for 8 rows and 88 ms for 16, while the
same weights prepacked for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`, the layout
oneDNN's matmul reads, what vLLM's CPU backend builds with `create_onednn_mm` and torch's
inductor with `_linear_pointwise`) took 40 and 53 ms; 64 rows 215 → 143, 264 rows 689 → 593
(best of 7, `scripts/gemm_paths.py`). A serving step of several users' decode rows and a prompt
chunk is such a GEMM, so it is where serving under load spends its time.

The packed copy is oneDNN's own (opaque) tensor beside the weight, which the module path,
transformers' forward and deterministic mode still read: the weights' memory is held twice
(SmolLM2-135M: +540 MB). `--no-packed-weights` (EngineConfig.packed_weights) turns it off.
The sums run in oneDNN's order: logits differ from F.linear's in the last bits, as they do
between any two batch shapes in the default mode; deterministic mode never takes this path.
"""
from __future__ import annotations

import torch


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype is torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


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
