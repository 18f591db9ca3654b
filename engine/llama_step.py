"""One forward of a Llama-family decoder (Llama, Mistral, Qwen2) written out over the pool.

The engine's steps on CPU skip transformers' module stack: a decode step of SmolLM2 ran
~3,000 small ops and ~20 ms of Python around ~25 ms of GEMMs (torch.profiler, 2 threads); here a
layer is one RMSNorm, one GEMM for q/k/v, rotary, the K/V write, paged attention, one GEMM for
o, one RMSNorm, one GEMM for gate/up, SiLU x up, one GEMM for down. q/k/v (and gate/up) become
row blocks of one weight each: `LlamaStep` concatenates them once and makes the modules' own
weights views of it, so transformers' own forward (HF generate, the bench's HF peers) still
runs on the same memory, and nothing is held twice.

The arithmetic is transformers' (the same RMSNorm, rotary and activation ops, attention by
`paged.paged_attention`); only the GEMMs are grouped differently, so logits agree with the
module path to float32 rounding, as they do between any two batch shapes in the default mode.
Where the compiled kernels are built (native.py, float32 CPU, a SiLU model) the element-wise
work runs in three compiled passes a layer instead of some twenty torch ops: rotary with the
K/V write into the pool, the residual add with the next RMSNorm (twice), SiLU x up — the same
formulas, one pass over the rows each (a cold 540-token prompt at one thread: 1297 -> 1251 ms of
thread CPU; an 8-row decode step 52.9 -> 49.0 ms).
In deterministic mode every GEMM (the fused ones included) runs in its calibrated tiles
(`invariance.tiled_linear`) and attention takes its exact per-query path, as on the module path,
but without a TorchFunctionMode's Python call on every op.

Used only for models whose layers have exactly this structure (`LlamaStep.for_model` checks
each class and config flag it relies on) and on CPU (the GPU path is not measured here).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native
from .invariance import LinearPlan, tiled_linear
from .packed import can_pack, pack, packed_linear
from .paged import StepPlan, paged_attention
from .skinny import skinny_mm, written_out_rows

_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}


def _fuse(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the linears' rows in order; the linears keep views of it.
    A second runner on the same model finds the first one's (the views still point into it)."""
    done = getattr(linears[0], "_kvplay_fused", None)
    if done is not None and all(lin.weight.data_ptr() == done[0][i].data_ptr()
                                for i, lin in zip(done[2], linears)):
        return done[0], done[1]
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears])
    start, starts = 0, []
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[start:start + n], requires_grad=False)
        starts.append(start)
        start += n
    linears[0]._kvplay_fused = (weight, bias, starts)
    return weight, bias


@dataclass
class _Layer:
    norm1: torch.Tensor
    eps1: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    norm2: torch.Tensor
    eps2: float
    gate_up: torch.Tensor
    down: torch.Tensor
    act: object
    attn: torch.nn.Module  # for its scaling and the attention call's `module` argument
    window: int | None
    packed: tuple = (None, None, None, None)  # oneDNN copies of qkv, o, gate_up, down (packed.py)


class LlamaStep:
    def __init__(self, model, packed: bool = True):
        inner = model.model
        cfg = inner.config
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.weight
        self.eps = inner.norm.variance_epsilon
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.layers = []
        # the compiled passes (native.py) compute SiLU and a full-width rotary
        self.fusable = (getattr(cfg, "hidden_act", None) == "silu" and self.head_dim % 2 == 0
                        and self.embed.weight.dtype is torch.float32)
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse([a.q_proj, a.k_proj, a.v_proj])
            gate_up, _ = _fuse([m.gate_proj, m.up_proj])
            window = getattr(a, "sliding_window", getattr(cfg, "sliding_window", None)) or None
            self.layers.append(_Layer(
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, qkv, qkv_bias,
                a.o_proj.weight, layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon, gate_up, m.down_proj.weight,
                m.act_fn, a, window))
        # oneDNN's packed copies of every layer weight (packed.py): all of them, or none held
        # (checked before any copy is made: `pack` keeps each copy on its weight)
        weights = [(L.qkv, L.o, L.gate_up, L.down) for L in self.layers]
        self.packed = packed and all(can_pack(w) for ws in weights for w in ws)
        if self.packed:
            got = [tuple(pack(w) for w in ws) for ws in weights]
            self.packed = all(p is not None for layer in got for p in layer)  # oneDNN may refuse
            if self.packed:
                for L, layer in zip(self.layers, got):
                    L.packed = layer

    @classmethod
    def for_model(cls, model, packed: bool = True) -> "LlamaStep | None":
        """A LlamaStep when every part of `model` is one this module writes out, else None."""
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or not layers or not hasattr(inner, "rotary_emb"):
            return None
        cfg = inner.config
        if getattr(cfg, "mlp_bias", False) or getattr(cfg, "pretraining_tp", 1) != 1:
            return None
        if type(inner.norm).__name__ not in _NORMS or type(inner.embed_tokens) is not torch.nn.Embedding:
            return None
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if (type(layer).__name__ not in _LAYERS
                    or {type(layer.input_layernorm).__name__, type(layer.post_attention_layernorm).__name__} - _NORMS
                    or any(type(lin) is not torch.nn.Linear for lin in
                           (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj))
                    or a.o_proj.bias is not None
                    or len({lin.bias is None for lin in (a.q_proj, a.k_proj, a.v_proj)}) != 1):
                return None
        return cls(model, packed)

    def _linear_for(self, det: LinearPlan | None, n: int, dtype: torch.dtype, threads: int):
        """This step's GEMM, called as linear(x, weight, bias, packed weight): deterministic
        mode's tiles; else oneDNN's packed weights (packed.py) where they exist, one row on one
        thread too (on the AVX-512 EPYC a one-row forward of SmolLM2-135M took 48 ms packed, 53
        ms on F.linear's GEMV); without them F.linear's GEMV for one row on one thread,
        `skinny_mm` for few rows, F.linear."""
        if det is not None:
            return lambda x, w, b, p: tiled_linear(det, x, w, b, p)  # p: None where not packed
        if self.packed:
            return lambda x, w, b, p: packed_linear(x, p, b)
        if n == 1 and threads == 1:
            return lambda x, w, b, p: F.linear(x, w, b)
        if dtype is torch.float32 and n <= written_out_rows(threads):
            def few_rows(x, w, b, p):
                y = skinny_mm(x, w, threads)
                return y if b is None else y + b
            return few_rows
        return lambda x, w, b, p: F.linear(x, w, b)

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # transformers' LlamaRMSNorm (in float32); for float32 models torch's own rms_norm, one
        # op instead of six, gives the same bits (tests/engine/test_llama_step.py checks it)
        if x.dtype is not torch.float32:
            h = x.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return F.rms_norm(x, w.shape, w, eps)

    @staticmethod
    def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
        """sin with its first half negated, made once a step: rotate_half(x) * sin is then
        x.roll(half) * signed (the same products, bit for bit: (-a) * b == a * (-b))."""
        half = sin.shape[-1] // 2
        return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # transformers' x * cos + rotate_half(x) * sin, with rotate_half as one roll (was
        # slice, slice, neg, cat on every layer)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan,
                store, threads: int, det: LinearPlan | None = None,
                lib: "native.Kernels | None" = None) -> torch.Tensor:
        """input_ids, positions: [1, N]; returns the final hidden states [N, hidden]. `det`:
        deterministic mode's calibrated GEMM shapes (every GEMM in its tiles, invariance.py).
        `lib`: the compiled kernels, to run the work between the GEMMs in them (`fusable` models,
        a float32 pool)."""
        n = input_ids.shape[1]
        x = self.embed(input_ids[0])  # [N, hidden]
        linear = self._linear_for(det, n, x.dtype, threads)
        if lib is not None and store.data.dtype is torch.float32:
            return self._fused_forward(lib, x, positions, plan, store, threads, linear)
        cos, sin = self.rotary(x, positions)  # [1, N, D]
        cos, sin = cos[0].unsqueeze(1), self._signed_sin(sin[0].unsqueeze(1))  # [N, 1, D]
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        k_end = (hq + hk) * d
        for i, L in enumerate(self.layers):
            h = self._rms(x, L.norm1, L.eps1)
            qkv_p, o_p, gate_up_p, down_p = L.packed
            qkv = linear(h, L.qkv, L.qkv_bias, qkv_p)  # [N, (hq + 2 hk) d]
            qk = self._rotate(qkv[:, :k_end].view(n, hq + hk, d), cos, sin)  # q and k heads at once
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, k_end:].view(n, hk, d)
            kpool, vpool = store.data[i][0], store.data[i][1]  # [hk, slots, d]
            if k.dtype is not kpool.dtype:  # a cache dtype of its own
                k, v = k.to(kpool.dtype), v.to(vpool.dtype)
            kpool.index_copy_(1, plan.write_slots, k.transpose(0, 1))
            vpool.index_copy_(1, plan.write_slots, v.transpose(0, 1))
            if n > 1:  # SDPA takes its math path for strided multi-token queries
                q = q.contiguous()
            o, _ = paged_attention(L.attn, q.transpose(0, 1).unsqueeze(0), kpool, vpool, None,
                                   scaling=L.attn.scaling, sliding_window=L.window, kvplay_plan=plan)
            x = x + linear(o.view(n, hq * d), L.o, None, o_p)
            h = self._rms(x, L.norm2, L.eps2)
            gu = linear(h, L.gate_up, None, gate_up_p)
            inter = gu.shape[1] // 2
            x = x + linear(L.act(gu[:, :inter]) * gu[:, inter:], L.down, None, down_p)
        return self._rms(x, self.norm, self.eps)

    def _fused_forward(self, lib: "native.Kernels", x: torch.Tensor, positions: torch.Tensor,
                       plan: StepPlan, store, threads: int, linear) -> torch.Tensor:
        """`forward` with the element-wise work in compiled passes, one call each (native.py):
        RMSNorm with the residual add before it, rotary with the K/V write into the pool (q into
        a packed buffer), SiLU x up. Per layer: 4 GEMMs, attention and 3 such calls. Each token's
        row is computed alone in a fixed order (deterministic mode runs it too)."""
        n = x.shape[0]
        cos, sin = self.rotary(x, positions)  # [1, N, D]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        h = native.rms_norm(lib, x, self.layers[0].norm1, self.layers[0].eps1, threads)
        for i, L in enumerate(self.layers):
            qkv_p, o_p, gate_up_p, down_p = L.packed
            qkv = _rows(linear(h, L.qkv, L.qkv_bias, qkv_p))  # [N, (hq + 2 hk) d]
            kpool, vpool = store.data[i][0], store.data[i][1]  # [hk, slots, d]
            q = native.rope_write(lib, qkv, hq, hk, d, cos, sin, plan.write_slots, kpool, vpool, threads)
            q = q.transpose(0, 1).unsqueeze(0)  # [1, hq, N, d], a view: the kernels read it strided
            if n > 1 and (plan.prefill is None or L.window is not None):
                q = q.contiguous()  # SDPA takes its math path for strided multi-token queries
            o, _ = paged_attention(L.attn, q, kpool, vpool, None,
                                   scaling=L.attn.scaling, sliding_window=L.window, kvplay_plan=plan)
            attn = _rows(linear(o.view(n, hq * d), L.o, None, o_p))
            h = native.rms_norm(lib, x, L.norm2, L.eps2, threads, delta=attn)  # x += attn
            gu = _rows(linear(h, L.gate_up, None, gate_up_p))
            act = native.silu_mul(lib, gu, threads)
            down = _rows(linear(act, L.down, None, down_p))
            last = i + 1 == len(self.layers)
            norm, eps = (self.norm, self.eps) if last else (self.layers[i + 1].norm1, self.layers[i + 1].eps1)
            h = native.rms_norm(lib, x, norm, eps, threads, delta=down)  # x += down
        return h


def _rows(y: torch.Tensor) -> torch.Tensor:
    """y [N, M] with contiguous rows, as the compiled passes read it (skinny_mm hands back a
    transposed view)."""
    return y if y.is_contiguous() else y.contiguous()
