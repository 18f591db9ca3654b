"""Cascade attention for decode rows that share a prefix of the same physical KV blocks.

The prefix cache hands requests on the same prompt the same block ids, so a decode step often has
several one-query rows whose first blocks are the very same pool slots. Attending row by row
gathers those keys and reads them once per row. Here the shared part is attended once for every
row of a group (the rows' queries stacked against one K/V: one kernel call instead of one per
row), each row's own remaining keys separately, and the two partial results merged exactly by
their log-sum-exps (FlashInfer's cascade, vLLM's `cascade_attention`):

    out = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2) = lerp(o2, o1, sigmoid(lse1 - lse2))

`plan_groups` finds the groups once per step (the runner's plan); `attend_group` runs one group in
one layer. Used only in the default mode on CPU, for layers without a sliding window (paged.py):
deterministic mode keeps every query on exactly its own keys, because there a row's result may
not depend on which other rows share its step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The CPU flash kernel SDPA dispatches to, called directly: it also returns the log-sum-exp.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
AVAILABLE = _FLASH is not None

# A group pays when what it saves, (rows - 1) x (shared keys + ROW_KEYS), reaches MIN_SAVED_KEYS:
# each row it takes off the per-row path saves the shared keys' reading and a kernel call (worth
# about ROW_KEYS keys), against its own fixed cost (two kernel calls and the merge). Fitted to one
# layer of SmolLM2-135M's attention at one thread (2 rows pay from ~200 shared keys, 4 from ~16).
ROW_KEYS = 96
MIN_SAVED_KEYS = 288


@dataclass
class Keys:
    """A run of key slots: `first` when they are consecutive in the pool (a view), else `slots`."""
    first: int | None
    slots: torch.Tensor  # [n] flat pool slots
    n: int

    def of(self, pool: torch.Tensor) -> torch.Tensor:
        """pool [H, slots, D] -> these keys (or values) [1, H, n, D]."""
        if self.first is not None:
            return pool[:, self.first:self.first + self.n].unsqueeze(0)
        return pool.index_select(1, self.slots).unsqueeze(0)


@dataclass
class Group:
    """Decode rows whose first `shared.n` keys are the same pool slots."""
    rows: list[int]
    q_idx: torch.Tensor  # [R] the rows' query positions in the step's packed token axis
    shared: Keys
    own: list  # per row: Keys of its keys after the shared ones, None when it has none
    # every row's own keys in one padded gather ([R x width] slots; the padding masked by
    # own_mask [R, 1, 1, width]), when the padding costs less than a kernel call per row
    own_pad: torch.Tensor | None = None
    own_mask: torch.Tensor | None = None
    empty: torch.Tensor | None = None  # rows with no own keys (their own side weighs 0)


# Padding a row's own keys to the group's longest costs less than its own kernel call up to
# about this many keys (scripts/step_paths.py, one thread).
PAD_KEYS = 128


def first_slot(blocks: list[int], block_size: int) -> int | None:
    """The first slot of `blocks` (not empty) when they are consecutive block ids, else None."""
    if blocks[-1] - blocks[0] == len(blocks) - 1 and all(b + 1 == c for b, c in zip(blocks, blocks[1:])):
        return blocks[0] * block_size
    return None


def _padded(rows: list[int], own: list, row_slots: list[torch.Tensor], shared_n: int, dtype):
    """(own_pad, own_mask) for one group, or (None, None) when padding costs more than it saves."""
    lens = [0 if k is None else k.n for k in own]
    width = max(1, max(lens))  # a row without own keys attends one masked-in key, weighed 0 later
    if len(rows) * width - sum(lens) > PAD_KEYS * len(rows):
        return None, None
    pad = row_slots[rows[0]][0]
    slots = torch.stack([torch.cat([row_slots[r][shared_n:], pad.expand(width - n)]) for r, n in zip(rows, lens)])
    mask = torch.zeros((len(rows), 1, 1, width), dtype=dtype, device=pad.device)
    for j, n in enumerate(lens):
        mask[j, :, :, max(n, 1):] = float("-inf")
    return slots.view(-1), mask


def plan_groups(used: list[list[int]], totals: list[int], q_lens: list[int], q_starts: list[int],
                row_slots: list[torch.Tensor], block_size: int,
                dtype=torch.float32) -> tuple[list[Group], list[int]]:
    """(groups, every row in none) for one step. `used[r]`: the blocks row r reads, `totals[r]`
    its keys (past + new). Decode rows with the same first block form a candidate; their shared
    part is their longest common run of block ids among the blocks each reads in full. `dtype`:
    the model's (the padding mask's)."""
    by_first: dict[int, list[int]] = {}
    for r, n in enumerate(q_lens):
        if n == 1:
            by_first.setdefault(used[r][0], []).append(r)
    groups, grouped = [], set()
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        ref = used[rows[0]]
        p = min(totals[r] for r in rows) // block_size  # blocks every row reads in full
        for r in rows[1:]:
            table, k = used[r], 0
            while k < p and table[k] == ref[k]:
                k += 1
            p = k
        shared_n = p * block_size
        if p == 0 or (len(rows) - 1) * (shared_n + ROW_KEYS) < MIN_SAVED_KEYS:
            continue
        own = []
        for r in rows:
            n = totals[r] - shared_n
            own.append(Keys(first_slot(used[r][p:], block_size), row_slots[r][shared_n:], n) if n else None)
        dev = row_slots[0].device
        empty = [j for j, k in enumerate(own) if k is None]
        own_pad, own_mask = _padded(rows, own, row_slots, shared_n, dtype)
        groups.append(Group(rows, torch.tensor([q_starts[r] for r in rows], device=dev),
                            Keys(first_slot(ref[:p], block_size), row_slots[rows[0]][:shared_n], shared_n),
                            own, own_pad, own_mask, torch.tensor(empty, device=dev) if empty else None))
        grouped.update(rows)
    return groups, [r for r in range(len(q_lens)) if r not in grouped]


def attend_group(query: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, group: Group,
                 scaling: float | None, out: torch.Tensor) -> None:
    """One group's rows in one layer. query [1, Hq, N, D] (rows packed); kpool, vpool: the
    layer's pool [Hkv, slots, D]; writes the rows' outputs into out [1, N, Hq, D]."""
    hk, d = kpool.shape[0], query.shape[3]
    g = query.shape[1] // hk  # query heads per kv head (GQA): folded into the query axis
    r = len(group.rows)
    q = query[0].index_select(1, group.q_idx)  # [Hq, R, D], head h on kv head h // g
    o1, lse1 = _FLASH(q.view(1, hk, g * r, d), group.shared.of(kpool), group.shared.of(vpool),
                      scale=scaling)
    o1, lse1 = o1.view(hk, g, r, d).permute(2, 0, 1, 3), lse1.view(hk, g, r).permute(2, 0, 1)  # [R, hk, g, ..]
    if group.own_pad is not None:  # every row's own keys in one call: a batch of R, padding masked
        k = kpool.index_select(1, group.own_pad).view(hk, r, -1, d).transpose(0, 1)
        v = vpool.index_select(1, group.own_pad).view(hk, r, -1, d).transpose(0, 1)
        o2, lse2 = _FLASH(q.view(hk, g, r, d).permute(2, 0, 1, 3), k, v, attn_mask=group.own_mask,
                          scale=scaling)
    else:  # one call per row
        o2s, l2s = [], []
        for j, keys in enumerate(group.own):
            qj = q[:, j].view(1, hk, g, d)
            if keys is None:  # attends its first shared key, weighed 0 below
                keys = Keys(group.shared.first, group.shared.slots[:1], 1)
            o, lse = _FLASH(qj, keys.of(kpool), keys.of(vpool), scale=scaling)
            o2s.append(o[0])
            l2s.append(lse[0])
        o2, lse2 = torch.stack(o2s), torch.stack(l2s)
    if group.empty is not None:  # rows whose whole context is the shared part
        lse2 = lse2.index_fill(0, group.empty, float("-inf"))
    # e^lse1 o1 + e^lse2 o2 over e^lse1 + e^lse2: o2 + (o1 - o2) e^lse1 / (e^lse1 + e^lse2)
    w1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1)
    merged = torch.lerp(o2, o1, w1.to(o1.dtype))
    out[0].index_copy_(0, group.q_idx, merged.reshape(r, hk * g, d))
