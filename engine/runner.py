"""ModelRunner: one batched forward over the pool.

Takes rows of (block table, tokens already in the pool, new tokens), packs every row's new
tokens into one sequence (no padding: the linear layers see exactly the step's N tokens), builds
the StepPlan (where each new token's K/V goes, each row's key slots and positions), runs the
model — on CPU, for Llama, Qwen2 and Mistral, as the decoder written out (llama_step.py);
otherwise transformers' modules with a PagedCache and paged attention (paged.py) — and returns
the logits of each row's last new token. Deterministic mode runs every GEMM in calibrated tiles
(invariance.py: `tiled_linear`, or BatchInvariantLinear around the modules).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

from . import cascade as cascade_mod
from . import native as native_mod
from .invariance import BatchInvariantLinear, LinearPlan, tiled_linear
from .paged import ATTN_NAME, PagedCache, StepPlan
from .skinny import decode_step, install, max_rows, skinny_linear
from .kv_store import KVStore
from .packed import pack, packed_linear
from .llama_step import LlamaStep


@dataclass
class Row:
    block_table: list[int]
    past_len: int  # tokens of this request already in the pool (computed or cached)
    new_tokens: list[int]  # tokens to compute now, at positions past_len ...


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_geometry(model) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder-only model."""
    cfg = _text_config(model.config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


class ModelRunner:
    def __init__(self, loaded, num_blocks: int, block_size: int, packed: bool = True,
                 cascade: bool = True, native: bool = True, fused: bool = True):
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        layers, kv_heads, head_dim = kv_geometry(self.model)
        self.store = KVStore(num_blocks, block_size, layers, kv_heads, head_dim, self.dtype, self.device)
        self.block_size = block_size
        self.cache = PagedCache(self.store, layers)
        cfg = self.model.config
        cfg._attn_implementation = ATTN_NAME
        text_cfg = _text_config(cfg)
        if text_cfg is not cfg:
            text_cfg._attn_implementation = ATTN_NAME
        self.max_positions = getattr(text_cfg, "max_position_embeddings", None) or 1 << 30
        self.forwards = 0
        # decode rows sharing prefix blocks attend over them once per group (cascade.py): CPU only
        self.cascade = cascade and self.device.type == "cpu" and cascade_mod.AVAILABLE
        self.grouped_rows = 0  # decode rows that took the cascade, all steps together
        # every decode row, and every prompt chunk, in one compiled call a layer each (native.py):
        # CPU, float32; it supersedes the cascade, which stays for where the kernels are not built
        compiled = self.device.type == "cpu" and self.dtype is torch.float32 and native_mod.kernel() is not None
        self.native = native and compiled
        self.native_rows = 0  # decode rows planned for the compiled kernel, all steps together
        self.prefill_rows = 0  # rows planned for the compiled prefill kernel, all steps together
        self.linear_plan = None  # deterministic mode's calibrated GEMM row counts (invariance.py)
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        params = inspect.signature(self.model.model.forward).parameters
        # transformers >= 5.24 names it `cache` (`past_key_values` is a deprecated alias).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Steps on CPU run the decoder written out (llama_step.py) when the model fits it.
        self.llama_step = LlamaStep.for_model(self.model, packed) if self.device.type == "cpu" else None
        # norms, rotary + the K/V write, SiLU x up in compiled passes (native.py, llama_step.py)
        self.fused = fused and compiled and self.llama_step is not None and self.llama_step.fusable
        head = self.model.lm_head
        self.head_packed = (pack(head.weight) if self.llama_step is not None and self.llama_step.packed
                            and type(head) is torch.nn.Linear else None)
        if self.device.type == "cpu" and self.llama_step is None:
            install(self.model.model)  # the modules' decode steps take skinny.py; lm_head below

    def decode_attention(self, deterministic: bool) -> str:
        """How this runner attends decode rows, in words (start-up lines and bench labels)."""
        if deterministic:
            return "exact per query, compiled kernel (deterministic)" if self.native else "exact per query (deterministic)"
        if self.native:
            return "compiled kernel"
        if self.cascade:
            return "torch, shared prefixes once (cascade)"
        return "torch, per row"

    def _plan(self, rows: list[Row], deterministic: bool):
        """Pack every row's new tokens into one sequence: [1, N] ids and positions, no padding."""
        bs = self.block_size
        dev = self.device
        ids, pos, writes, row_slots, runs, starts, tables = [], [], [], [], [], [], []
        n_tok = 0
        for r in rows:
            n = len(r.new_tokens)
            total = r.past_len + n
            table = torch.tensor(r.block_table, dtype=torch.long)
            p = torch.arange(total)
            slots = table[p // bs] * bs + p % bs
            row_slots.append(slots.to(dev))
            used = r.block_table[:(total - 1) // bs + 1]
            tables.append(used)
            runs.append(cascade_mod.first_slot(used, bs))
            writes.append(slots[r.past_len:])
            ids.extend(r.new_tokens)
            pos.append(p[r.past_len:])
            starts.append(n_tok)
            n_tok += n
        plan = StepPlan(
            write_slots=torch.cat(writes).to(dev), row_slots=row_slots, row_runs=runs, q_starts=starts,
            past_lens=[r.past_len for r in rows], q_lens=[len(r.new_tokens) for r in rows],
            deterministic=deterministic)
        decode = [r for r, n in enumerate(plan.q_lens) if n == 1]
        if self.native:  # every row by a compiled kernel (paged.py); deterministic: all by the exact one
            chunks = list(range(len(rows))) if deterministic else [r for r, n in enumerate(plan.q_lens) if n != 1]
            if decode and not deterministic:
                plan.decode = native_mod.KernelRows.of(decode, row_slots, starts, plan.past_lens)
                self.native_rows += len(decode)
            if chunks:
                plan.prefill = native_mod.KernelRows.of(chunks, row_slots, starts, plan.past_lens)
                self.prefill_rows += len(chunks)
        elif self.cascade and not deterministic and len(rows) > 1:  # once per step, never per layer
            plan.cascade, plan.solo = cascade_mod.plan_groups(
                tables, [past + n for past, n in zip(plan.past_lens, plan.q_lens)], plan.q_lens, starts,
                row_slots, bs, self.dtype)
            self.grouped_rows += len(plan.cascade.rows) if plan.cascade is not None else 0
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        positions = torch.cat(pos).view(1, -1).to(dev)
        return input_ids, positions, plan

    def warm_up(self, blocks: list[int], tokens: int, deterministic: bool = False) -> int:
        """One throwaway forward of a `tokens`-token prompt, its K/V written into `blocks` —
        free blocks, which hold nothing anyone reads — so the first real prompt of that size
        does not pay what a first forward costs: the step's activations faulted into the heap
        (heap.py keeps them there afterwards), the pool pages of the blocks the first requests
        get (the pool hands out never-used blocks first), oneDNN's first calls at that row
        count (in deterministic mode: its GEMM calibration, invariance.py). vLLM's CPU worker
        runs a dummy forward of its step budget at start too. Not counted in `forwards`.
        Returns the prompt's length (0: nothing run)."""
        n = min(tokens, len(blocks) * self.block_size, self.max_positions)
        if n < 2:
            return 0
        vocab = max(1, min(64, getattr(_text_config(self.model.config), "vocab_size", 64) or 64))
        counts = self.forwards, self.native_rows, self.prefill_rows
        self.forward([Row(blocks, 0, [i % vocab for i in range(n)])], deterministic)
        self.forwards, self.native_rows, self.prefill_rows = counts
        return n

    @torch.inference_mode()
    def forward(self, rows: list[Row], deterministic: bool = False) -> torch.Tensor:
        """Run one step; return float32 logits [len(rows), vocab] of each row's last new token."""
        input_ids, positions, plan = self._plan(rows, deterministic)
        self.cache.plan = plan
        if deterministic and self.linear_plan is None:
            self.linear_plan = LinearPlan()  # calibrates each GEMM shape on first use (invariance.py)
        threads = torch.get_num_threads()
        det = self.linear_plan if deterministic else None
        try:
            if self.llama_step is not None:  # the decoder written out (llama_step.py)
                hidden = self.llama_step.forward(input_ids, positions, plan, self.store, threads, det,
                                                 native_mod.kernel() if self.fused else None)
            else:
                if deterministic:
                    mode = BatchInvariantLinear(self.linear_plan)
                elif self.device.type == "cpu" and input_ids.shape[1] <= max_rows(threads):
                    mode = decode_step(threads)  # every weight read once, on every thread (skinny.py)
                else:
                    mode = contextlib.nullcontext()
                with mode:
                    # The 4-D placeholder tells transformers the mask is prepared (it returns it
                    # as is); paged attention builds each row's own causal/window mask from the plan.
                    out = self.model.model(input_ids=input_ids, attention_mask=self._no_mask,
                                           position_ids=positions, use_cache=True, kvplay_plan=plan,
                                           **{self._cache_kw: self.cache})
                hidden = out.last_hidden_state[0]  # [N, hidden]
            last = torch.tensor([s + n - 1 for s, n in zip(plan.q_starts, plan.q_lens)],
                                device=hidden.device)
            rows = hidden.index_select(0, last)
            head = self.model.lm_head
            if type(head) is not torch.nn.Linear:
                logits = head(rows)
            elif det is not None:
                logits = tiled_linear(det, rows, head.weight, head.bias, self.head_packed)
            elif self.head_packed is not None:  # one row on one thread too (llama_step._linear_for)
                logits = packed_linear(rows, self.head_packed, head.bias)
            else:  # the biggest weight of a small model: a prefill step reads it for a few rows too
                logits = skinny_linear(rows, head.weight, head.bias, threads)
        finally:
            self.cache.plan = None
        self.forwards += 1
        return logits.float()
