"""Cascade attention for decode rows that share a prefix of the same physical KV blocks.

The prefix cache hands requests on the same prompt the same block ids, so a decode step often has
several one-query rows whose first blocks are the very same pool slots. Attending row by row
gathers those keys and reads them once per row. Here the shared part is attended once for every
row of a group (the rows' queries stacked against one K/V: one kernel call instead of one per
row), each row's own remaining keys on their own, and the two partial results merged exactly by
their log-sum-exps (FlashInfer's cascade, vLLM's `cascade_attention`):

    out = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2) = lerp(o2, o1, sigmoid(lse1 - lse2))

A decode row that shares its prefix with no other row is a group of one when its leading blocks
are consecutive in the pool (`SOLO_KEYS`): that run is a view, so only the rest of its keys are
gathered, not all of them every layer.

`plan_groups` finds the groups once per step (the runner's plan); `attend` runs them in one
layer: one call per group for the shared side, one call for every grouped row's own side (their
own keys padded to the longest and masked, or one call per row where padding would cost more),
one merge. Used only in the default mode on CPU, for layers without a sliding window (paged.py):
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
# about ROW_KEYS keys), against the group's own fixed cost (a kernel call, its share of the own
# keys' call and the merge). Fitted, with a margin, to one layer of SmolLM2-135M's attention at
# one thread (2 rows paid from ~200 shared keys, 4 from ~16, 8 from 16): 2 rows group from 288
# shared keys, 3 from 96, 4 from 32, 5 or more from one block.
ROW_KEYS = 96
MIN_SAVED_KEYS = 384


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


@dataclass
class Cascade:
    """One step's groups. Their rows' own keys (after each group's shared ones) are attended
    together, and the two sides merged for all of them at once."""
    groups: list[Group]
    rows: list[int]  # every grouped row, group after group
    q_idx: torch.Tensor  # their query positions
    own: list  # per row: Keys of its own keys, None when it has none
    # every row's own keys in one padded gather ([rows x width] slots; the padding masked by
    # own_mask [rows, 1, 1, width]), when the padding costs less than a kernel call per row
    own_pad: torch.Tensor | None
    own_mask: torch.Tensor | None
    empty: torch.Tensor | None  # rows with no own keys (their own side weighs 0)


# A decode row alone on its prefix is a group of one from this many leading consecutive keys: they
# are attended as a view of the pool and only the rest gathered, where the per-row path gathers
# all of them every layer. 8 decode rows as kvplay serve had them under vLLM's client at 8
# clients (prefixes held by 4, 2, 1 and 1 rows, own blocks scattered), SmolLM2-135M, median of 30
# forwards interleaved: 77.4 -> 68.6 ms at two threads, 94.7 -> 87.2 at one; level (within noise)
# for one row alone and for four rows on four prefixes, at 128 and at 256.
SOLO_KEYS = 128

# Padding a row's own keys to the longest costs less than its own kernel call up to about this
# many keys (one layer of SmolLM2-135M's attention at one thread).
PAD_KEYS = 128


def first_slot(blocks: list[int], block_size: int) -> int | None:
    """The first slot of `blocks` (not empty) when they are consecutive block ids, else None."""
    if blocks[-1] - blocks[0] == len(blocks) - 1 and all(b + 1 == c for b, c in zip(blocks, blocks[1:])):
        return blocks[0] * block_size
    return None


def _padded(own: list, pad: torch.Tensor, dtype):
    """(own_pad, own_mask), or (None, None) when padding costs more than a call per row saves.
    `pad`: a slot that exists (a row without own keys attends it, weighed 0 later)."""
    lens = [0 if k is None else k.n for k in own]
    width = max(1, max(lens))
    if len(own) * width - sum(lens) > PAD_KEYS * len(own):
        return None, None
    slots = torch.stack([pad.expand(width) if k is None else torch.cat([k.slots, pad.expand(width - k.n)])
                         for k in own])
    mask = torch.zeros((len(own), 1, 1, width), dtype=dtype, device=pad.device)
    for j, n in enumerate(lens):
        mask[j, :, :, max(n, 1):] = float("-inf")
    return slots.view(-1), mask


def plan_groups(used: list[list[int]], totals: list[int], q_lens: list[int], q_starts: list[int],
                row_slots: list[torch.Tensor], block_size: int,
                dtype=torch.float32) -> tuple[Cascade | None, list[int]]:
    """(the step's cascade or None, every row in no group). `used[r]`: the blocks row r reads,
    `totals[r]` its keys (past + new). Decode rows with the same first block form a candidate;
    their shared part is their longest common run of block ids among the blocks each reads in
    full. `dtype`: the model's (the padding mask's)."""
    by_first: dict[int, list[int]] = {}
    for r, n in enumerate(q_lens):
        if n == 1:
            by_first.setdefault(used[r][0], []).append(r)
    dev = row_slots[0].device
    groups, grouped, own = [], [], []
    for rows in by_first.values():
        ref = used[rows[0]]
        p = min(totals[r] for r in rows) // block_size  # blocks every row reads in full
        if len(rows) == 1:
            # a row alone on its prefix: its leading run of consecutive blocks is attended as a
            # view of the pool, only the rest gathered (a row's keys not all consecutive are
            # otherwise gathered whole, every layer)
            if first_slot(ref, block_size) is not None:
                continue  # all its blocks are consecutive: the per-row path reads it in place already
            k = 1 if p else 0
            while k < p and ref[k] == ref[k - 1] + 1:
                k += 1
            if k * block_size < SOLO_KEYS:
                continue
            p = k
        for r in rows[1:]:
            table, k = used[r], 0
            while k < p and table[k] == ref[k]:
                k += 1
            p = k
        shared_n = p * block_size
        if p == 0 or (len(rows) > 1 and (len(rows) - 1) * (shared_n + ROW_KEYS) < MIN_SAVED_KEYS):
            continue
        for r in rows:
            n = totals[r] - shared_n
            own.append(Keys(first_slot(used[r][p:], block_size), row_slots[r][shared_n:], n) if n else None)
        groups.append(Group(rows, torch.tensor([q_starts[r] for r in rows], device=dev),
                            Keys(first_slot(ref[:p], block_size), row_slots[rows[0]][:shared_n], shared_n)))
        grouped.extend(rows)
    if not groups:
        return None, list(range(len(q_lens)))
    empty = [j for j, k in enumerate(own) if k is None]
    own_pad, own_mask = _padded(own, row_slots[grouped[0]][0], dtype)
    taken = set(grouped)
    return (Cascade(groups, grouped, torch.tensor([q_starts[r] for r in grouped], device=dev), own,
                    own_pad, own_mask, torch.tensor(empty, device=dev) if empty else None),
            [r for r in range(len(q_lens)) if r not in taken])


def attend(query: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, plan: Cascade,
           scaling: float | None, out: torch.Tensor) -> None:
    """The grouped rows in one layer. query [1, Hq, N, D] (rows packed); kpool, vpool: the
    layer's pool [Hkv, slots, D]; writes the rows' outputs into out [1, N, Hq, D]."""
    hk, d = kpool.shape[0], query.shape[3]
    g = query.shape[1] // hk  # query heads per kv head (GQA): folded into the query axis
    # the shared side, one call per group: [R, hk, g, D] and [R, hk, g], head h on kv head h // g
    o1s, l1s = [], []
    for group in plan.groups:
        r = len(group.rows)
        q = query[0].index_select(1, group.q_idx).view(1, hk, g * r, d)
        o, lse = _FLASH(q, group.shared.of(kpool), group.shared.of(vpool), scale=scaling)
        o1s.append(o.view(hk, g, r, d).permute(2, 0, 1, 3))
        l1s.append(lse.view(hk, g, r).permute(2, 0, 1))
    o1, lse1 = (o1s[0], l1s[0]) if len(o1s) == 1 else (torch.cat(o1s), torch.cat(l1s))
    # each row's own side: one padded call for all of them, or one call per row
    r = len(plan.rows)
    q = query[0].index_select(1, plan.q_idx).view(hk, g, r, d).permute(2, 0, 1, 3)  # [R, hk, g, D]
    if plan.own_pad is not None:
        k = kpool.index_select(1, plan.own_pad).view(hk, r, -1, d).transpose(0, 1)
        v = vpool.index_select(1, plan.own_pad).view(hk, r, -1, d).transpose(0, 1)
        o2, lse2 = _FLASH(q, k, v, attn_mask=plan.own_mask, scale=scaling)
    else:
        o2s, l2s = [], []
        for j, keys in enumerate(plan.own):
            if keys is None:  # attends one key it holds, weighed 0 below
                keys = Keys(None, plan.groups[0].shared.slots[:1], 1)
            o, lse = _FLASH(q[j:j + 1], keys.of(kpool), keys.of(vpool), scale=scaling)
            o2s.append(o[0])
            l2s.append(lse[0])
        o2, lse2 = torch.stack(o2s), torch.stack(l2s)
    if plan.empty is not None:  # rows whose whole context is the shared part
        lse2 = lse2.index_fill(0, plan.empty, float("-inf"))
    # e^lse1 o1 + e^lse2 o2 over e^lse1 + e^lse2: o2 + (o1 - o2) e^lse1 / (e^lse1 + e^lse2)
    w1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1)
    merged = torch.lerp(o2, o1, w1.to(o1.dtype))
    out[0].index_copy_(0, plan.q_idx, merged.reshape(r, hk * g, d))
