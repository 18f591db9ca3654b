"""A mirror of a remote server's prefix cache, built from its KV events: one `Mirror` per pod,
a `Fleet` of them.

What a block knows: its hash, its parent's hash, its tokens, who stored it (`creator`) and who
holds it now (`holders`: the creator plus every session that reused it while it stayed cached —
vLLM re-announces reused blocks as `BlockStored` with the reusing request's `session_id` when the
request asks for ``kv_cache_report_mode = "full"``).

Attribution of a stored block, in order:
1. the event's `session_id` (vLLM copies it from the request body; SGLang sends it in metadata);
2. else the session whose registered prompt (`register_prompt`, called by kvplay's own panes for
   what they send) has the same token chain up to this block;
3. else `SOMEONE_ELSE` (another client of a shared server).

Counters (`summary()`): `blocks` cached now; `stored` block entries announced by `BlockStored`
(new and re-announced), `removed` blocks evicted, `cleared` cache resets; `by_session` blocks each
session holds now; `stored_by_session` blocks each session stored in all; `gaps`, `replayed` and
`restarts` are counted by the subscriber that feeds the mirror.

Only the device tier is mirrored: events for another medium (vLLM's CPU offload tier "CPU",
"STORAGE") or with locality "REMOTE" are counted in `other_medium` and otherwise ignored. Hybrid models' groups other than 0 are keyed by
(group, hash) so their hashes cannot alias group 0's.

Applying is plain dict work with no per-block allocations beyond the block itself, so one
process takes well over 50,000 events/s (`bench/mirror_bench.py`).
"""
from __future__ import annotations

import threading
from collections import Counter

from .codec import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, hash_hex

SOMEONE_ELSE = "someone else"
STATES = ("waiting", "live", "replaying", "stale")


def _elsewhere(ev: BlockStored | BlockRemoved) -> bool:
    """Blocks not in the pod's device tier (another medium, or a remote locality): not mirrored."""
    return (ev.medium is not None and ev.medium != MEDIUM_GPU) or ev.locality == "REMOTE"


class MirrorBlock:
    __slots__ = ("hash", "parent", "_tok", "_off", "size", "creator", "holders", "seq", "ts", "_chain")

    def __init__(self, h, parent, tok, off, size, creator, seq, ts):
        self.hash = h
        self.parent = parent
        self._tok = tok
        self._off = off
        self.size = size
        self.creator = creator
        self.holders = (creator,)
        self.seq = seq
        self.ts = ts
        self._chain = None

    @property
    def tokens(self) -> list[int]:
        return self._tok[self._off:self._off + self.size]

    @property
    def hex(self) -> str:
        return hash_hex(self.hash)

    def __repr__(self) -> str:
        return f"MirrorBlock({self.hex}, creator={self.creator!r}, holders={self.holders!r})"


class Mirror:
    """One pod's cache as its events describe it."""

    def __init__(self, pod: str = "pod0", prompts: "PromptIndex | None" = None):
        self.pod = pod
        self.blocks: dict = {}
        self.prompts = prompts if prompts is not None else PromptIndex()
        self.by_session: Counter = Counter()
        self.stored_by_session: Counter = Counter()
        self.stored = 0          # block entries in BlockStored events
        self.new_blocks = 0      # ... of which entered the cache (not resident before)
        self.reannounced = 0     # ... of which were already resident (reuse, report mode "full")
        self.removed = 0
        self.removed_unknown = 0  # BlockRemoved for a hash we never saw (joined late, lost batch)
        self.cleared = 0
        self.other_medium = 0
        self.gaps = 0
        self.replayed = 0
        self.restarts = 0
        self.lost = 0            # batches we know we never got (replay could not fill the gap)
        self.batches = 0
        self.events = 0
        self.last_seq = -1
        self.last_ts = 0.0
        self.state = "waiting"
        self.version = 0         # bumps on every change (views redraw when it moves)
        # When a list, every change is appended as a tuple (the recorder turns them into events):
        # ("stored", hash, parent, tokens, size, creator) | ("hit", hash, session, creator, size)
        # | ("removed", hash, creator or None) | ("cleared", reason)
        self.journal: list | None = None

    # --- applying events -----------------------------------------------------------------------
    def apply(self, batch: EventBatch, seq: int = -1) -> tuple[int, int, int]:
        """Apply one batch in order; returns (stored, removed, cleared) for that batch."""
        stored = removed = cleared = 0
        for ev in batch.events:
            cls = type(ev)
            if cls is BlockStored:
                stored += self._stored(ev, seq, batch.ts)
            elif cls is BlockRemoved:
                removed += self._removed(ev)
            elif cls is AllBlocksCleared:
                self.clear()
                cleared += 1
        self.batches += 1
        self.events += len(batch.events)
        if seq >= 0:
            self.last_seq = seq
        self.last_ts = batch.ts
        self.version += 1
        return stored, removed, cleared

    def _key(self, h, group_idx):
        return h if not group_idx else (group_idx, h)

    def _stored(self, ev: BlockStored, seq: int, ts: float) -> int:
        if _elsewhere(ev):
            self.other_medium += len(ev.block_hashes)
            return 0
        blocks = self.blocks
        by_session = self.by_session
        stored_by = self.stored_by_session
        g = ev.group_idx
        sid = ev.session_id
        parent = ev.parent_block_hash
        size = ev.block_size
        tok = ev.token_ids
        off = 0
        new = 0
        journal = self.journal
        for h in ev.block_hashes:
            key = (g, h) if g else h
            b = blocks.get(key)
            who = sid
            if b is None:
                if who is None:
                    who = self._attribute(parent, tok, off, size, g)
                blocks[key] = MirrorBlock(h, parent, tok, off, size, who, seq, ts)
                by_session[who] += 1
                new += 1
                if journal is not None:
                    journal.append(("stored", h, parent, tok[off:off + size], size, who))
            else:
                if who is None:
                    who = b.creator
                if who not in b.holders:
                    b.holders += (who,)
                    by_session[who] += 1
                if journal is not None:
                    journal.append(("hit", h, who, b.creator, size))
            stored_by[who] += 1
            parent = h
            off += size
        n = len(ev.block_hashes)
        self.new_blocks += new
        self.reannounced += n - new
        self.stored += n
        return n

    def _removed(self, ev: BlockRemoved) -> int:
        if _elsewhere(ev):
            self.other_medium += len(ev.block_hashes)
            return 0
        blocks = self.blocks
        by_session = self.by_session
        g = ev.group_idx
        n = 0
        for h in ev.block_hashes:
            b = blocks.pop((g, h) if g else h, None)
            if self.journal is not None:
                self.journal.append(("removed", h, None if b is None else b.creator))
            if b is None:
                self.removed_unknown += 1
                continue
            for who in b.holders:
                c = by_session[who] - 1
                if c:
                    by_session[who] = c
                else:
                    del by_session[who]
            n += 1
        self.removed += n
        return n

    def clear(self) -> None:
        """AllBlocksCleared (or a publisher restart): the cache is empty."""
        self.blocks.clear()
        self.by_session.clear()
        self.cleared += 1
        self.version += 1
        if self.journal is not None:
            self.journal.append(("cleared", "cleared"))

    def reset_for_restart(self) -> None:
        """The publisher restarted (its seq went backwards): its cache is gone with it."""
        self.blocks.clear()
        self.by_session.clear()
        self.restarts += 1
        self.last_seq = -1
        self.version += 1
        if self.journal is not None:
            self.journal.append(("cleared", "publisher restarted"))

    # --- attribution by token chain ----------------------------------------------------------
    def _chain_of(self, key, group_idx) -> int | None:
        """The token-chain id of a cached block (None when its chain leaves the mirror). Walks
        up iteratively: prompts can be thousands of blocks deep."""
        path = []
        b = self.blocks.get(key)
        while b is not None and b._chain is None:
            path.append(b)
            if b.parent is None:
                b = None
                chain = None
                break
            b = self.blocks.get(self._key(b.parent, group_idx))
        else:
            if b is None:
                return None
            chain = b._chain
        for blk in reversed(path):
            chain = blk._chain = hash((chain, tuple(blk.tokens)))
        return chain

    def _attribute(self, parent, tok, off, size, group_idx) -> str:
        if not self.prompts or not size:
            return SOMEONE_ELSE
        if parent is None:
            parent_chain = None
        else:
            parent_chain = self._chain_of(self._key(parent, group_idx), group_idx)
            if parent_chain is None:
                return SOMEONE_ELSE
        chain = hash((parent_chain, tuple(tok[off:off + size])))
        return self.prompts.lookup(chain, size) or SOMEONE_ELSE

    # --- views --------------------------------------------------------------------------------
    def creators(self) -> Counter:
        """Blocks cached now by the session that stored them (sums to `len(blocks)`)."""
        return Counter(b.creator for b in self.blocks.values())

    def summary(self) -> dict:
        return {"blocks": len(self.blocks), "by_session": dict(sorted(self.by_session.items())),
                "stored_by_session": dict(sorted(self.stored_by_session.items())),
                "stored": self.stored, "removed": self.removed, "gaps": self.gaps,
                "replayed": self.replayed, "restarts": self.restarts}


class PromptIndex:
    """Prompts kvplay's own panes sent, indexed by token chain per block size, so blocks stored
    without a session_id can still be attributed to the pane that caused them."""

    def __init__(self):
        self._prompts: list[tuple[str, tuple[int, ...]]] = []
        self._by_size: dict[int, dict[int, str]] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def register(self, session: str, token_ids) -> None:
        toks = tuple(token_ids)
        self._prompts.append((session, toks))
        for size, index in self._by_size.items():
            self._index(index, session, toks, size)

    @staticmethod
    def _index(index: dict, session: str, toks: tuple, size: int) -> None:
        chain = None
        for start in range(0, len(toks) - size + 1, size):
            chain = hash((chain, toks[start:start + size]))
            index.setdefault(chain, session)  # the first pane that sent a prefix stored it

    def lookup(self, chain: int, size: int) -> str | None:
        index = self._by_size.get(size)
        if index is None:
            index = self._by_size[size] = {}
            for session, toks in self._prompts:
                self._index(index, session, toks, size)
        return index.get(chain)


class Fleet:
    """Mirrors by pod name, sharing one prompt index (a pane's prompt may land on any pod)."""

    def __init__(self):
        self.prompts = PromptIndex()
        self.pods: dict[str, Mirror] = {}
        self.lock = threading.RLock()  # held while a batch is applied; views take it to read

    def pod(self, name: str) -> Mirror:
        m = self.pods.get(name)
        if m is None:
            m = self.pods[name] = Mirror(name, self.prompts)
        return m

    def register_prompt(self, session: str, token_ids) -> None:
        with self.lock:
            self.prompts.register(session, token_ids)

    def totals(self) -> dict:
        tot = {"blocks": 0, "stored": 0, "removed": 0, "gaps": 0, "replayed": 0, "restarts": 0}
        by_session: Counter = Counter()
        for m in self.pods.values():
            s = m.summary()
            for k in tot:
                tot[k] += s[k]
            by_session.update(m.by_session)
        tot["by_session"] = dict(sorted(by_session.items()))
        return tot

    def summary(self) -> dict:
        return {"summary": True, "pods": {name: m.summary() for name, m in self.pods.items()}}
