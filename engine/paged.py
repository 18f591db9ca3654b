"""Paged attention through transformers' Cache API.

A ``PagedCache`` is a transformers ``Cache`` whose layers write each step's new K/V into the
shared block pool (at the slots of each request's block table) and hand attention the K/V
gathered from the pool. Attention is our registered function ``kvplay_paged``: in the default
mode it is transformers' SDPA with a per-row causal mask over the gathered keys; in
deterministic mode it computes every query against exactly its own keys, and every linear
layer sees at least 16 rows (see ``BatchInvariantLinear``), so a token's logits do not depend on
whether its prefix came from the cache, on chunking, or on which other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "kvplay_paged"


@dataclass
class StepPlan:
    """Where one forward's tokens go. Rows are requests; row b has q_lens[b] new tokens after
    past_lens[b] tokens already in the pool."""
    write_slots: torch.Tensor  # [N] flat pool slots for the N valid new tokens
    write_rows: torch.Tensor  # [N] batch row of each
    write_cols: torch.Tensor  # [N] position within the row's new tokens
    gather_slots: torch.Tensor  # [B, Kmax] flat pool slots of each row's keys (padded)
    past_lens: list[int]
    q_lens: list[int]
    deterministic: bool


class PagedLayer(CacheLayerMixin):
    is_compileable = False

    def __init__(self, owner: "PagedCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - nothing lazy
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        plan = self.owner.plan
        store = self.owner.store.data[self.layer_idx]  # [2, slots, H, D]
        kpool, vpool = store[0], store[1]
        k = key_states.transpose(1, 2)  # [B, L, H, D]
        v = value_states.transpose(1, 2)
        kpool.index_copy_(0, plan.write_slots, k[plan.write_rows, plan.write_cols].to(kpool.dtype))
        vpool.index_copy_(0, plan.write_slots, v[plan.write_rows, plan.write_cols].to(vpool.dtype))
        b, kmax = plan.gather_slots.shape
        flat = plan.gather_slots.reshape(-1)
        keys = kpool.index_select(0, flat).view(b, kmax, *kpool.shape[1:]).transpose(1, 2)
        values = vpool.index_select(0, flat).view(b, kmax, *vpool.shape[1:]).transpose(1, 2)
        return keys, values

    def get_mask_sizes(self, query_length: int):
        return self.owner.plan.gather_slots.shape[1], 0

    def get_seq_length(self) -> int:
        plan = self.owner.plan
        return max(plan.past_lens) if plan else 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass


class PagedCache(Cache):
    def __init__(self, store, num_layers: int):
        self.store = store
        self.plan: StepPlan | None = None
        super().__init__(layers=[PagedLayer(self, i) for i in range(num_layers)])


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over pool-gathered K/V. query [B, Hq, L, D]; key/value [B, Hkv, Kmax, D]."""
    plan: StepPlan | None = kwargs.get("kvplay_plan")
    if plan is None:  # the model used outside the engine (e.g. HF generate): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if not plan.deterministic:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=False)
    gqa = query.shape[1] != key.shape[1]  # grouped-query attention without copying K/V per group
    b, h, l, d = query.shape
    out = query.new_zeros((b, l, h, d))
    # Half-precision SDPA calls on one query are several times slower on CPU than float32 ones;
    # the per-query loop runs in float32 (exact, and a pure function of each query's inputs).
    work = torch.float32 if query.device.type == "cpu" else query.dtype
    query = query.to(work)
    for row in range(b):
        past = plan.past_lens[row]
        k, v = key[row:row + 1].to(work), value[row:row + 1].to(work)
        for i in range(plan.q_lens[row]):
            n = past + i + 1  # exactly this token's keys: no padding, no mask
            o = F.scaled_dot_product_attention(query[row:row + 1, :, i:i + 1], k[:, :, :n], v[:, :, :n],
                                               scale=scaling, enable_gqa=gqa)
            out[row, i] = o[0, :, 0].to(out.dtype)
    return out, None


AttentionInterface.register(ATTN_NAME, paged_attention)
# Outside the engine the model still builds ordinary SDPA masks.
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
