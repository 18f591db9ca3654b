"""Paged attention through transformers' Cache API.

The runner packs every row's new tokens into one sequence (batch 1, N tokens: no padding, so
the linear layers see exactly N rows). A ``PagedCache`` is a transformers ``Cache`` whose layers
write each step's new K/V into the shared pool (at the slots of each request's block table) and
hand attention the pool itself. Attention is our registered function ``kvplay_paged``: for each
row it gathers exactly that row's keys from the pool and calls torch SDPA with grouped K/V
(``enable_gqa``, no copy per query head) and a causal (and, for sliding-window layers, windowed)
mask only where one is needed (decode rows need none).

On CPU in float32, the compiled kernels (``native.py``) attend every row of a step in place,
each row's keys read from the pool through its slots: one call a layer for the decode rows, one
for the prompt chunks (causal within the chunk, over the cached blocks before it). Where they are
not built, decode rows that share a prefix of the same physical blocks (the prefix cache makes
this common) attend over the shared blocks once for all of them (``cascade.py``) and prompt
chunks take SDPA row by row. Sliding-window layers always take SDPA row by row.

In deterministic mode every query is computed against exactly its own keys — by the prefill
kernel for every row, decode rows included (a query's bits there depend only on its own vector
and keys), or, without the kernels, by one SDPA call per query — and every linear layer runs only
calibrated row counts (see ``invariance.py``), so a token's logits do not depend on whether its
prefix came from the cache, on chunking, or on which other requests share the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import native
from .cascade import Cascade, attend as attend_cascade

ATTN_NAME = "kvplay_paged"


@dataclass
class StepPlan:
    """Where one forward's tokens go. Rows are requests; row b has q_lens[b] new tokens after
    past_lens[b] tokens already in the pool, packed at q_starts[b] in the step's token axis."""
    write_slots: torch.Tensor  # [N] flat pool slots of the N new tokens, in packed order
    row_slots: list  # per row: LongTensor [past + q_len] flat pool slots of all its keys
    row_runs: list  # per row: its first slot when all its slots are consecutive, else None
    q_starts: list[int]
    past_lens: list[int]
    q_lens: list[int]
    deterministic: bool
    cascade: Cascade | None = None  # decode rows sharing prefix blocks, grouped (cascade.py)
    solo: list = field(default_factory=list)  # the rows in no group (when there are groups)
    decode: native.KernelRows | None = None  # decode rows for the compiled kernel (native.py)
    prefill: native.KernelRows | None = None  # rows for the compiled prefill kernel
    rest: list = field(default_factory=list)  # the rows in neither (when either is set)
    _masks: dict = field(default_factory=dict)

    def key_range(self, row: int, window: int | None) -> int:
        """First key position any of the row's new queries can see."""
        if window is None:
            return 0
        return max(0, self.past_lens[row] - window + 1)

    def mask(self, row: int, window: int | None, device):
        """(attn_mask, is_causal) for the row's queries over keys key_range(..) .. past+q_len-1."""
        past, n = self.past_lens[row], self.q_lens[row]
        if n == 1:
            return None, False  # one query sees every gathered key
        if past == 0 and (window is None or n <= window):
            return None, True  # square causal: SDPA's own (top-left) causal mask is right
        key = (row, window)
        if key not in self._masks:
            start = self.key_range(row, window)
            kpos = torch.arange(start, past + n, device=device).view(1, -1)
            qpos = torch.arange(past, past + n, device=device).view(-1, 1)
            m = kpos <= qpos
            if window is not None:
                m &= kpos > qpos - window
            self._masks[key] = m
        return self._masks[key], False


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
        """Write the step's new K/V ([1, H, N, D]) into the pool; hand attention the pool."""
        plan = self.owner.plan
        store = self.owner.store.data[self.layer_idx]  # [2, H, slots, D]
        kpool, vpool = store[0], store[1]
        kpool.index_copy_(1, plan.write_slots, key_states[0].to(kpool.dtype))
        vpool.index_copy_(1, plan.write_slots, value_states[0].to(vpool.dtype))
        return kpool, vpool

    def get_mask_sizes(self, query_length: int):
        plan = self.owner.plan
        return max(p + q for p, q in zip(plan.past_lens, plan.q_lens)), 0

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


def _row_kv(pool, plan: StepPlan, row: int, start: int):
    """The row's keys (or values) from position `start`: [1, H, S, D]. A row whose blocks are
    consecutive in the pool (the common case: blocks are handed out in id order) is a view of
    the pool, no copy; otherwise one gather. Deterministic mode always gathers, so a query sees
    identically laid-out keys whether its prefix was cached or computed."""
    first = plan.row_runs[row]
    if first is not None and not plan.deterministic:
        end = first + plan.past_lens[row] + plan.q_lens[row]
        return pool[:, first + start:end].unsqueeze(0)
    slots = plan.row_slots[row]
    if start:
        slots = slots[start:]
    return pool.index_select(1, slots).unsqueeze(0)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, **kwargs):
    """query [1, Hq, N, D] (rows packed); key/value: the layer's pool [Hkv, slots, D]."""
    plan: StepPlan | None = kwargs.get("kvplay_plan")
    if plan is None:  # the model used outside the engine (e.g. HF generate): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    window = sliding_window or None
    gqa = query.shape[1] != key.shape[0]
    h, d = query.shape[1], query.shape[3]
    out = query.new_empty((1, query.shape[2], h, d))
    rows = range(len(plan.q_starts))
    if (plan.decode is not None or plan.prefill is not None) and window is None and _native(
            plan, query, key, value, scaling, out):  # every row in one call per kind, keys in place
        rows = plan.rest
    elif plan.cascade is not None and window is None:  # shared prefixes attended once per group
        attend_cascade(query, key, value, plan.cascade, scaling, out)
        rows = plan.solo
    for row in rows:
        s, n = plan.q_starts[row], plan.q_lens[row]
        start = plan.key_range(row, window)
        k = _row_kv(key, plan, row, start)
        v = _row_kv(value, plan, row, start)
        q = query[:, :, s:s + n]
        if plan.deterministic:
            out[0, s:s + n] = _exact_queries(q, k, v, plan.past_lens[row], start, window, scaling, gqa)
            continue
        mask, causal = plan.mask(row, window, query.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scaling,
                                           enable_gqa=gqa)
        out[0, s:s + n] = o[0].transpose(0, 1)
    return out, None


def _native(plan: StepPlan, query, key, value, scaling, out) -> bool:
    """The plan's decode rows and prompt rows by the compiled kernels; False (the caller then
    attends every row itself) when a kernel does not take this layout."""
    lib, threads = native.kernel(), torch.get_num_threads()
    if plan.decode is not None and not native.decode_attention(lib, query, key, value, plan.decode,
                                                               scaling, out, threads):
        return False
    return plan.prefill is None or native.prefill_attention(lib, query, key, value, plan.prefill, scaling,
                                                            out, threads)


def _exact_queries(q, k, v, past, start, window, scaling, gqa):
    """Each query against exactly its own keys: no padding, no mask, so its result is a pure
    function of its inputs. Half-precision SDPA calls on one query are several times slower on
    CPU than float32 ones, so the loop runs in float32 there (exact)."""
    work = torch.float32 if q.device.type == "cpu" else q.dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    n = q.shape[2]
    out = q.new_empty((n, q.shape[1], q.shape[3]))
    for i in range(n):
        pos = past + i
        lo = 0 if window is None else max(0, pos - window + 1) - start
        hi = pos + 1 - start
        o = F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, lo:hi], v[:, :, lo:hi],
                                           scale=scaling, enable_gqa=gqa)
        out[i] = o[0, :, 0]
    return out


AttentionInterface.register(ATTN_NAME, paged_attention)
# Outside the engine the model still builds ordinary SDPA masks.
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
