"""ModelRunner: one batched forward over the pool.

Takes rows of (block table, tokens already in the pool, new tokens), builds the StepPlan (slot
mapping, gather table, positions, per-row causal mask), runs the transformers model with a
PagedCache, and returns the logits of each row's last new token.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

from .invariance import BatchInvariantLinear, calibrate
from .paged import ATTN_NAME, PagedCache, StepPlan
from .pool import KVStore


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
    def __init__(self, loaded, num_blocks: int, block_size: int):
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
        self.linear_plan = None  # deterministic mode's calibrated row counts (invariance.py)
        params = inspect.signature(self.model.model.forward).parameters
        # transformers >= 5.24 names it `cache` (`past_key_values` is a deprecated alias).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _plan(self, rows: list[Row], deterministic: bool):
        bs = self.block_size
        dev = self.device
        b = len(rows)
        lmax = max(len(r.new_tokens) for r in rows)
        kmax = max(r.past_len + len(r.new_tokens) for r in rows)
        input_ids = torch.zeros((b, lmax), dtype=torch.long)
        positions = torch.zeros((b, lmax), dtype=torch.long)
        limits = torch.ones((b, lmax), dtype=torch.long)  # keys visible to each query (padded rows: 1)
        gather = torch.zeros((b, kmax), dtype=torch.long)
        w_slots, w_rows, w_cols = [], [], []
        for i, r in enumerate(rows):
            n = len(r.new_tokens)
            total = r.past_len + n
            table = torch.tensor(r.block_table, dtype=torch.long)
            pos = torch.arange(total)
            slots = table[pos // bs] * bs + pos % bs
            gather[i, :total] = slots
            input_ids[i, :n] = torch.tensor(r.new_tokens, dtype=torch.long)
            positions[i, :n] = torch.arange(r.past_len, total)
            limits[i, :n] = torch.arange(r.past_len + 1, total + 1)
            w_slots.append(slots[r.past_len:])
            w_rows.append(torch.full((n,), i, dtype=torch.long))
            w_cols.append(torch.arange(n))
        key_pos = torch.arange(kmax).view(1, 1, 1, kmax)
        mask = key_pos < limits.view(b, 1, lmax, 1)
        plan = StepPlan(
            write_slots=torch.cat(w_slots).to(dev), write_rows=torch.cat(w_rows).to(dev),
            write_cols=torch.cat(w_cols).to(dev), gather_slots=gather.to(dev),
            past_lens=[r.past_len for r in rows], q_lens=[len(r.new_tokens) for r in rows],
            deterministic=deterministic)
        return input_ids.to(dev), positions.to(dev), mask.to(dev), plan

    @torch.inference_mode()
    def forward(self, rows: list[Row], deterministic: bool = False) -> torch.Tensor:
        """Run one step; return float32 logits [len(rows), vocab] of each row's last new token."""
        input_ids, positions, mask, plan = self._plan(rows, deterministic)
        self.cache.plan = plan
        if deterministic and self.linear_plan is None:
            self.linear_plan = calibrate(self.model)  # once per engine, ~0.5 s on a 135M model
        mode = BatchInvariantLinear(self.linear_plan) if deterministic else contextlib.nullcontext()
        with mode:
            out = self.model.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                   use_cache=True, kvplay_plan=plan, **{self._cache_kw: self.cache})
            hidden = out.last_hidden_state
            last = torch.tensor([len(r.new_tokens) - 1 for r in rows], device=hidden.device)
            h = hidden[torch.arange(len(rows), device=hidden.device), last]  # [B, hidden]
            logits = self.model.lm_head(h)
        self.cache.plan = None
        self.forwards += 1
        return logits.float()
