"""Why a watched server computed what it computed, from its KV events alone: `kvplay watch
--json`'s per-batch `miss`, the summary's `misses`, attach's per-turn miss line (`explain_prompt`)
and the prefix tree's marks. A consumer of each pod's translated engine batches (wire/translate.py)
after its Mirror applied them (the same batches a recording holds, so a recorded session replays
through it too).

**Per chain.** Every chain of new blocks a ``BlockStored`` announces gets the reasons
engine/miss.py gives an uncached prompt block, as far as events tell them:

- a **tier** hit: its first blocks are held by another cache tier (``TierBlocks``: vLLM's CPU
  offload, FS/OBJ/"STORAGE" tiers, a "REMOTE" locality): loaded from there, not computed;
- **evicted** / **cleared** / **config** (recomputed): its first block's hash was stored and
  removed before (the pod's `RemovedLog`, engine/miss.py), and so on, block by block, while that
  holds (the check is closed under prefixes: a block's hash chains on its parent's). With when
  it was removed and `evicted_by`: the BlockRemoved's own `by_user` (kvplay's engine names it),
  else the session that stored the most new blocks in the batch of the removal — vLLM's
  BlockRemoved names no request, and its evictions come in the step that needed the room;
- **isolated** / **diverged**: the chain branches from a cached block that has another cached
  child (at the root: a cached first block that starts with the same token). The same tokens
  as that sibling under another hash means other keys went into the hash: `isolated` when
  either side lists extra keys (a salt), `config` when neither does (a hash seed, a model);
  else `diverged`: `at` is the branch's position (its block index x block size) plus the tokens
  its first block shares with the closest sibling; `from` is the sibling's creator. Every
  block of the chain counts, as the engine counts every block after a divergence point;
- **cold**: the rest: new content — the blocks a request's decode filled are cold too (events do
  not say which tokens were prompt).

Counts are blocks and tokens (blocks x block size), per pod, per session (the events'
`user`, the server's session_id) and per batch. What events alone cannot tell: the tail (a
request's partial last block is never stored), hits (vLLM re-announces them only for requests
with kv_cache_report_mode "full": the Mirror counts those), and isolation deeper than a chain's
branch point; attach, which knows each turn's prompt, explains it whole (`explain_prompt`:
engine/miss.py's attribution over the Mirror through `MirrorPool`).

**Compiled.** The per-event loop runs in C where it can be built (csrc/miss_chains.c through
wire/miss_native.py: the same loop over the same objects, the usual chains inline: a cold one,
a branch from a cached block, a chain recomputed after a removal; the usual eviction too, into
the RemovedLog's compiled recent map, csrc/recent_map.h), with this module's Python loop
(`PodMisses._scan`, over a dict) as its reference and fallback; the tests run both on every
batch. What it costs the mirror: docs/miss.md ("Cost", `python -m kvplay.bench.mirror_bench
--no-socket --misses`).

**Found through the mirror.** A chain is one tuple per stored event. The mirror slot of each
of its blocks names it (`chain_at`), and the slot of a cached parent names the newest chain
stored under it (`heads_at`): a cached key's chain is `chain_at[key_slot[key]]`, and a chain
lives while a slot names it. So there is no map of every stored key to sweep: what is held
follows the pool by construction.

**Bounded.** Per pod: the `RemovedLog` (at most 20,480 recent removals with details, where it
is compiled in generations of 4,096 keys with an index and a filter each, 0.63-0.74 MiB, then
blocked Bloom filters: 0.75 MiB a reason, a
false positive rate of about 3.1e-4 over all three); a chain and a parent's newest chain per mirror slot; the newest root chain per first
token (swept to the cached ones when they outnumber twice the cached blocks); `TIER_KEYS`
hashes held by other tiers and `BY_AT` batches' evicting sessions (each up to `FORGET_SLACK`
more, let go that many at a time); `MAX_SESSIONS` sessions and `MAX_TIERS` tiers counted by name
(the rest as "others").
"""
from __future__ import annotations

import time
from collections import Counter
from itertools import islice, repeat
from typing import Callable

from kvplay.engine import events as ev_
from kvplay.engine.miss import (EXCERPT_CHARS, EXCERPT_TOKENS, REMOVAL_REASONS, MissTracker,
                                Removal, RemovedLog, miss_object)

from . import miss_native
from .mirror import Mirror
from .tree import frozen_extra

COUNTED = ("tier", "evicted", "cleared", "config", "isolated", "diverged", "cold")
_AT = {r: i for i, r in enumerate(COUNTED)}  # a reason's place in a session's counts
_NC = len(COUNTED)
_COLD, _COLD_T = _AT["cold"], _AT["cold"] + _NC
TIER_KEYS = 1 << 18     # hashes remembered as held by another tier, per pod (the newest)
MAX_TIERS = 16          # tiers counted by name
MAX_SESSIONS = 4096     # sessions counted by name
OTHERS = "others"
MAX_DETAILS = 64        # recomputed / branch entries listed per batch
SWEEP_SLACK = 1 << 16   # roots beyond twice the cached blocks before a sweep
DETOKENIZE_PER_S = 16   # /detokenize calls a pod's branch texts may make per second
COMPARED = 4            # sibling blocks compared token by token at a branch (the likeliest first)
BY_AT = 16384 + 4096    # batches whose evicting session is remembered (as many as the RemovedLog's details)
FORGET_SLACK = 4096     # entries past a newest-N dict's bound before its oldest are forgotten, in one go

# A chain of blocks stored in one event is one tuple (the compiled loop's a `Chain`, read as a
# tuple and outside the garbage collector: csrc/miss_chains.c): the depth of its first block in blocks (None: unknown, its parent's chain
# was not seen), its parent's key, its creator, whether its first block lists extra keys (a
# salt), its mark for the prefix tree (None, or a tuple: see `PodMisses.marks`), then its keys
# (the mirror's, in order) from index HDR on.
DEPTH, PARENT, USER, SALTED, MARK, HDR = range(6)
_NONE = repeat(None)  # map(d.pop, keys, _NONE): pop each key, no error when absent


def _forget_oldest(d: dict, keep: int) -> None:
    """Keep a dict's newest `keep` entries once it holds FORGET_SLACK more, in one go. (Deleting
    the oldest entry each time it grows by one walks, on every call, past the entries deleted
    before: a dict leaves them in place until it is resized, about 3 µs a batch at 20,000.)"""
    if len(d) > keep + FORGET_SLACK:
        for k in list(islice(d, len(d) - keep)):
            del d[k]


def _ikey(key) -> int:
    """A mirror key as the RemovedLog's int: a server's int hash as it is; a hex digest, a
    (group or pod, hash) key by Python's hash (in memory only, like the log)."""
    return key if key.__class__ is int else hash(key)


def _ikeys(keys) -> list:
    return keys if keys and keys[0].__class__ is int else list(map(hash, keys))


def _find(chain: tuple | None, key) -> tuple:
    """(chain, the index of `key` in it), or (None, -1) when it holds no such key."""
    if chain is not None:
        try:
            return chain, chain.index(key, HDR)
        except ValueError:
            pass
    return None, -1


def _head(heads_at: list, ps: int | None, pk):
    """The newest chain stored under the cached parent `pk` in slot `ps` (None)."""
    if ps is None:
        return None
    h = heads_at[ps]
    return h if h is not None and (h[PARENT] is pk or h[PARENT] == pk) else None


def common_prefix(a, b) -> int:
    """How many leading tokens two blocks share."""
    if a == b:
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _new_counts() -> dict:
    return {"blocks": dict.fromkeys(COUNTED, 0), "tokens": dict.fromkeys(COUNTED, 0)}


class PodMisses:
    """One pod's attribution (see the module docstring): `apply(batch)` after its Mirror applied
    the batch. `explain`: also keep engine/miss.py's MissTracker (attach's per-turn line);
    `detokenize(ids) -> str`: text for branch points (rate-limited)."""

    def __init__(self, mirror, explain: bool = False, detokenize: Callable | None = None):
        self.mirror = mirror
        self._compiled = miss_native.scan(_AT)  # the compiled `_scan`, or None
        self.native = True  # False: the Python `_scan` (what the compiled one is checked against)
        self.removed = RemovedLog(flusher=miss_native.flusher(), filterer=miss_native.filterer(),
                                  recent_map=miss_native.recent_map())
        self.tracker = MissTracker(1, removed=self.removed) if explain else None
        self.detokenize = detokenize
        self.chain_at: list = []  # mirror slot -> the chain that last stored a block in it (None)
        self.heads_at: list = []  # mirror slot -> the newest chain stored under the block in it
        self.roots: dict = {}    # first token -> the newest chain with no parent that starts with it
        self.tier_of: dict = {}  # key -> the other tier that holds it (the newest TIER_KEYS, and up to FORGET_SLACK more)
        self.tiers: dict = {}    # tier -> {"stored", "removed", "hits"} blocks
        # (read through the properties `sessions`, `evicted_from` and `counts`, which first settle
        # what the compiled loop left pending: `_pending`, csrc/pending.h)
        self._sessions: dict = {}  # session -> [blocks by reason (COUNTED's order)..., then tokens]
        self._evicted_from: Counter = Counter()  # creator -> its blocks evicted
        self._counts = _new_counts()
        self._pending = miss_native.pending()
        self.last_top: str | None = None  # who stored the most in the last batch that stored
        self.by_at: dict = {}  # a batch's time -> who stored the most in it (evicted its removals)
        self._unnamed: list = []  # the tracker's evictions of this batch that named no evicting session
        self._detok_budget = (0.0, 0)

    # --- the batch -------------------------------------------------------------------------
    def apply(self, batch: ev_.EngineBatch, detail: bool = False) -> dict | None:
        """Attribute `batch`'s new chains; with `detail`, what this batch added (None when
        nothing), for `kvplay watch --json`.

        The per-event loop (`_scan`) runs compiled where it can be built (wire/miss_native.py:
        the same loop in C over the same objects, with the usual chains inline: a cold one, a
        branch from a cached block); the batch's counts, its usual evictions and who evicted
        them are entered at its end, in one go."""
        rep = None
        if detail:
            rep = _new_counts()
            rep["recomputed"], rep["branches"], rep["tiers"] = [], [], {}
        pod = batch.pod
        if len(self.chain_at) < self.mirror.hw:  # a slot for each of the mirror's
            grow = [None] * (self.mirror.hw - len(self.chain_at))
            self.chain_at += grow
            self.heads_at += grow
        tracking = self.tracker is not None
        usual_rm = pod is None and not tracking
        scan = self._compiled if self.native else None
        if scan is not None:  # (it enters who stored the most, `last_top`, and `by_at`, itself)
            tally, later, fill, whose, evicted, gone = scan(self, batch.events, pod, rep, usual_rm, tracking,
                                                            batch.ts, MAX_SESSIONS, self._pending)
        else:
            tally, later, fill, whose, evicted, gone = self._scan(batch.events, pod, rep, usual_rm, tracking,
                                                                  batch.ts)
            if fill:
                self.last_top = max(fill, key=fill.get)
            if evicted or gone:
                self.by_at[batch.ts] = self.last_top
        if later:
            self._count_later(later, tally)
        if tally is not None:  # (None: the compiled loop counted them)
            self._tally(tally, rep)
        if whose:
            self._whose(whose)
        if (evicted or gone) and (self._unnamed or len(self.by_at) > BY_AT + FORGET_SLACK):
            self._evicted_by(batch.ts)
        if len(self.roots) > 2 * len(self.mirror.key_slot) + SWEEP_SLACK:
            self._sweep()
        if rep is None or (not any(rep["blocks"].values()) and not rep["tiers"]):
            return None
        rep["blocks"] = {k: v for k, v in rep["blocks"].items() if v}
        rep["tokens"] = {k: v for k, v in rep["tokens"].items() if v}
        return rep

    def _scan(self, events, pod, rep, usual_rm: bool, tracking: bool, bts: float) -> tuple:
        """A batch's events, in order: each new chain's reason (a cold one and a branch from a
        cached block inline, as `_branch` finds it; the rest through `_special`), counted for its session; removals entered in the RemovedLog
        (the usual ones — evictions that name no evicting session, at the batch's time — with
        one Removal for all); tiers and clears. Returns (its blocks by reason (COUNTED's order)
        then tokens, the chains of sessions not counted yet (session, reason's place or -1, its
        blocks, the chain's blocks, block size), {session: blocks stored}, whose blocks the usual
        evictions were, whether another eviction needs its evicting session, how many usual
        evictions). csrc/miss_chains.c is this loop compiled: keep the two the same (the tests run
        both).

        A chain is found through the mirror: a cached key's slot (`key_slot`), then the chain
        that last stored a block in that slot (`chain_at`); the newest chain under a cached
        parent is `heads_at` at the parent's slot (when its parent is that key)."""
        chain_at, heads_at, roots, held = self.chain_at, self.heads_at, self.roots, self.tier_of
        roots_get = roots.get
        cached = self.mirror.key_slot
        slot_of = cached.get
        off = self.mirror.offset
        nslots = len(chain_at)
        tv = self.mirror.tokens.v  # slot -> its tokens (the mirror's list)
        removed = self.removed
        recent_get, blooms, filtered = removed.recent.get, removed.blooms, removed.filtered
        Stored, Removed = ev_.BlockStored, ev_.BlockRemoved
        fill: dict = {}
        sget = self._sessions.get
        tally = [0] * (2 * _NC)
        later: list = []
        evicted = False
        gone = 0
        whose: list = []
        usual = None  # Removal("evicted", bts), made on the batch's first usual eviction
        for ev in events:
            cls = ev.__class__
            if cls is Stored:
                hs = ev.block_hashes
                n = len(hs)
                if not n:
                    continue
                if pod is not None or ev.group_idx:
                    hs, pk = self._keys(ev, pod)
                else:
                    pk = ev.parent_block_hash
                user, size = ev.user, ev.block_size
                fill[user] = fill.get(user, 0) + n
                toks = ev.token_ids
                ps = None  # the parent's slot
                if pk is None:
                    pr, at, depth = None, -1, 0
                    sibs = roots_get(toks[0]) if toks else None
                else:
                    ps = slot_of(pk)
                    pr, at = _find(chain_at[ps], pk) if ps is not None else (None, -1)  # the parent's chain, its index there
                    if pr is None:
                        depth = None
                        sibs = _head(heads_at, ps, pk)
                    else:
                        depth = pr[DEPTH]
                        if depth is not None:
                            depth += at - HDR + 1
                        nxt = at + 1
                        s = slot_of(pr[nxt]) if nxt < len(pr) else None
                        if s is not None and chain_at[s] is pr:
                            sibs = True  # the parent's own chain goes on
                        else:
                            sibs = _head(heads_at, ps, pk)
                k0 = hs[0]
                ik = k0 if k0.__class__ is int else hash(k0)
                r = recent_get(ik)
                if r is None:
                    if blooms:
                        r = filtered(ik)
                extras = ev.extra_keys
                salted = bool(extras) and extras[0] is not None
                run = (depth, pk, user, salted, None, *hs)
                ri = -1  # the place of its reason in COUNTED (-1: cold), and how many blocks have it
                if r is None and sibs and size and len(toks) == n * size and not (held and k0 in held):
                    # a branch (`_branch`, inline): the rest of the parent's chain, then the newest
                    # chain under the parent (at the root: with the same first token), if cached
                    tt = tuple(toks)
                    mine = tt[:size]
                    best, sr, si = -1, None, 0
                    if sibs is True:
                        theirs = tv[cached[pr[at + 1]]] or ()
                        best = size if mine == theirs else common_prefix(mine, theirs)
                        sr, si = pr, at + 1
                        sibs = _head(heads_at, ps, pk)
                    if sibs is not None and sibs is not pr:
                        k = sibs[HDR]
                        s = slot_of(k)
                        if s is not None and chain_at[s] is sibs:
                            theirs = tv[s] or ()
                            c = size if mine == theirs else common_prefix(mine, theirs)
                            if c > best:
                                best, sr, si = c, sibs, HDR
                    if sr is not None:  # (else no cached sibling: cold)
                        who = sr[USER]
                        if best == size:  # the same tokens under another hash: other keys
                            reason = "isolated" if salted or (si == HDR and sr[SALTED]) else "config"
                            k, o = 1, size
                            for key in sr[si + 1:si + n]:  # how many blocks after it are the same
                                s = slot_of(key)
                                if s is None or chain_at[s] is not sr or tv[s] != tt[o:o + size]:
                                    break
                                k += 1
                                o += size
                            if rep is not None and len(rep["branches"]) < MAX_DETAILS:
                                rep["branches"].append({"session": user, "reason": reason, "blocks": k,
                                                        "tokens": k * size, "from": who})
                            mark = ("branch", reason, None, None, who, k)
                        else:
                            reason = "diverged"
                            pos = None if depth is None else depth * size + best
                            if rep is not None and len(rep["branches"]) < MAX_DETAILS:
                                d = {"session": user, "reason": "diverged", "at": pos, "within_block": best,
                                     "blocks": n, "tokens": n * size, "from": who}
                                text = self._excerpt(pr, at, toks, size, self._tokens(sr[si]), best)
                                if text is not None:
                                    d["text"] = {"prompt": text[0], "cached": text[1]}
                                rep["branches"].append(d)
                            mark = ("branch", "diverged", pos, best, who, n)
                        run = (depth, pk, user, salted, mark, *hs)
                        ri, q = _AT[reason], mark[-1]
                elif r is not None or sibs or (held and k0 in held):
                    run = self._special(ev, run, r, pr, at, sibs, rep)
                    mark = run[MARK]
                    if mark is not None:
                        ri, q = _AT[mark[1] if mark[0] != "tier" else "tier"], mark[-1]
                sc = sget(user)  # count it: its session's counts now (`_count_later` when it has none yet)
                if sc is None:
                    later.append((user, ri, q if ri >= 0 else 0, n, size))
                elif ri < 0:
                    sc[_COLD] += n
                    sc[_COLD_T] += n * size
                    tally[_COLD] += n
                    tally[_COLD_T] += n * size
                else:
                    t = q * size
                    sc[ri] += q
                    sc[ri + _NC] += t
                    tally[ri] += q
                    tally[ri + _NC] += t
                    if q < n:
                        sc[_COLD] += n - q
                        sc[_COLD_T] += (n - q) * size
                        tally[_COLD] += n - q
                        tally[_COLD_T] += (n - q) * size
                for b in ev.block_ids[:n]:  # (the mirror's slots of its blocks)
                    b -= off
                    if 0 <= b < nslots:
                        chain_at[b] = run
                if ps is not None:
                    heads_at[ps] = run
                elif pk is None and toks:
                    roots[toks[0]] = run
                if tracking:
                    self._track(ev, hs, pk, toks, size)
            elif cls is Removed:
                hs = ev.block_hashes
                if not hs:
                    continue
                cr = ev.creators
                if usual_rm and len(cr) == len(hs) and not ev.group_idx and ev.reason == "evicted" \
                        and not ev.by_user and ev.ts == bts:
                    if usual is None:
                        usual = Removal("evicted", bts)
                    removed.add_all(_ikeys(hs), usual)
                    gone += len(hs)
                    whose += cr
                else:
                    evicted |= self._removed(ev, pod)
            elif cls is ev_.TierBlocks:
                self._tier(ev, pod, rep)
            elif cls is ev_.AllBlocksCleared:
                self._cleared()
        return tally, later, fill, whose, evicted, gone

    def _cleared(self) -> None:
        """An AllBlocksCleared: no cached block has children, or is a root, any more."""
        self.heads_at[:] = repeat(None, len(self.heads_at))
        self.roots.clear()

    @staticmethod
    def _keys(ev, pod) -> tuple[list, object]:
        """(the mirror keys of an event's blocks, its parent's key), as wire/mirror.py keys them:
        (pod, hash) in a recording of watched pods, (group, hash) for a group other than 0."""
        hashes, parent = ev.block_hashes, getattr(ev, "parent_block_hash", None)
        tag = pod if pod is not None else ev.group_idx
        if tag:
            return [(tag, h) for h in hashes], (None if parent is None else (tag, parent))
        return hashes, parent

    def _removed(self, ev, pod) -> bool:
        """Enter a BlockRemoved's blocks into the RemovedLog (when, whose, and who evicted them:
        its `by_user` when it names one; else `evicted_by` finds out at the batch's end); True
        when it evicted."""
        keys = self._keys(ev, pod)[0] if pod is not None or ev.group_idx else ev.block_hashes
        reason = REMOVAL_REASONS.get(ev.reason, "cleared")
        evicted = reason == "evicted"
        by = (ev.by_user or None) if evicted else None
        policy = ev.policy if evicted else ""
        creators = ev.creators
        ikeys = _ikeys(keys)
        if len(creators) == len(keys):
            if len(set(creators)) == 1:
                removals = repeat(Removal(reason, ev.ts, policy, by, creators[0] or None))
            else:
                made = {c: Removal(reason, ev.ts, policy, by, c or None) for c in set(creators)}
                removals = map(made.__getitem__, creators)
            if evicted:
                self._whose(creators)
        else:  # (a damaged recording: no creators)
            removals = repeat(Removal(reason, ev.ts, policy, by, None))
        tr = self.tracker
        if tr is not None and len(ev.block_ids) == len(keys):  # it forgets them, and logs them
            tr.removed_blocks([(k, b, c) for k, b, c in zip(ikeys, ev.block_ids, creators or repeat(None))],
                              ev.reason, ev.ts, by, policy)
            if evicted and by is None:  # who evicted them is known at the batch's end (`_evicted_by`)
                self._unnamed.append((ikeys, creators if len(creators) == len(keys) else None, ev.ts, policy))
        else:
            self.removed.add_many(ikeys, removals)
        return evicted and by is None

    def _whose(self, creators: list) -> None:
        """Each creator's evicted blocks, each not counted by name yet as OTHERS once
        `MAX_SESSIONS` are (the compiled loop's `count_whose` and csrc/pending.h do the same)."""
        ev_from = self._evicted_from
        for c in creators:
            ev_from[c if c in ev_from or len(ev_from) < MAX_SESSIONS else OTHERS] += 1

    # --- the counters: what the compiled loop left pending settled first ----------------------
    def _settle(self) -> None:
        p = self._pending
        if p is not None and p.waiting:
            p.settle(self._evicted_from, self._counts, MAX_SESSIONS)

    @property
    def sessions(self) -> dict:
        """session -> [blocks by reason (COUNTED's order)..., then tokens]."""
        self._settle()
        return self._sessions

    @property
    def evicted_from(self) -> Counter:
        """creator -> its blocks evicted (the first `MAX_SESSIONS` by name)."""
        self._settle()
        return self._evicted_from

    @property
    def counts(self) -> dict:
        """{"blocks": {reason: n}, "tokens": {reason: n}} over the pod."""
        self._settle()
        return self._counts

    def _evicted_by(self, ts: float) -> None:
        """Who evicted what the batch at `ts` removed without saying: who stored the most in it
        (vLLM evicts in the step that needs the room; `apply` entered it in `by_at`, or the
        compiled loop did): the tracker's entries named, the oldest batches forgotten."""
        by_at = self.by_at
        top = by_at.get(ts)
        for ikeys, creators, when, policy in self._unnamed:  # the tracker's log entries, named
            self.removed.add_many(ikeys, (Removal("evicted", when, policy, top, c or None)
                                          for c in (creators or repeat(None, len(ikeys)))))
        self._unnamed.clear()
        _forget_oldest(by_at, BY_AT)

    def by_of(self, r: Removal) -> str | None:
        """Who evicted a remembered removal (None: not known)."""
        return r.by or self.by_at.get(r.ts)

    def _count_later(self, later: list, tally: list) -> None:
        """Count the chains of the sessions that had no counts when the batch came: first what is
        not cold, in order, then each session's cold blocks, in the order the sessions first
        stored in the batch (so the first `MAX_SESSIONS` sessions are named, in that order);
        the batch's counts (`tally`) too."""
        sget = self._sessions.get
        colds: dict = {}
        for user, ri, q, n, size in later:
            if ri >= 0:
                t = q * size
                sc = sget(user) or self._session(user)
                sc[ri] += q
                sc[ri + _NC] += t
                tally[ri] += q
                tally[ri + _NC] += t
            c = colds.get(user)
            colds[user] = (n - q, (n - q) * size) if c is None else (c[0] + n - q, c[1] + (n - q) * size)
        for user, (n, t) in colds.items():
            if n:
                sc = sget(user) or self._session(user)
                sc[_COLD] += n
                sc[_COLD_T] += t
                tally[_COLD] += n
                tally[_COLD_T] += t

    def _tally(self, tally: list, rep) -> None:
        """Add a batch's counts (blocks by reason, then tokens) to the pod's and to `rep`'s."""
        blocks, tokens = self._counts["blocks"], self._counts["tokens"]
        for i, reason in enumerate(COUNTED):
            n = tally[i]
            if n:
                blocks[reason] += n
                tokens[reason] += tally[i + _NC]
                if rep is not None:
                    rep["blocks"][reason] += n
                    rep["tokens"][reason] += tally[i + _NC]

    def _session(self, user: str) -> list:
        """A session's counts, new (`OTHERS`' once `MAX_SESSIONS` are counted by name): blocks
        by reason (`COUNTED`'s order), then tokens."""
        sessions = self._sessions
        if len(sessions) >= MAX_SESSIONS:
            user = OTHERS
        return sessions.setdefault(user, [0] * (2 * _NC))

    def _tier(self, ev, pod, rep) -> None:
        tier = ev.tier
        counts = self.tiers.get(tier)
        if counts is None:
            if len(self.tiers) >= MAX_TIERS:
                tier = OTHERS
            counts = self.tiers.setdefault(tier, {"stored": 0, "removed": 0, "hits": 0})
        keys = self._keys(ev, pod)[0]
        held = self.tier_of
        n = len(keys)
        if ev.removed:
            counts["removed"] += n
            for k in keys:
                if held.get(k) == tier:
                    del held[k]
        else:
            counts["stored"] += n
            held.update(zip(keys, repeat(tier)))
            _forget_oldest(held, TIER_KEYS)
        if rep is not None:
            t = rep["tiers"].setdefault(tier, {"stored": 0, "removed": 0, "hits": 0})
            t["removed" if ev.removed else "stored"] += n

    # --- a new chain -----------------------------------------------------------------------
    def _special(self, ev, run: tuple, r: Removal | None, pr: tuple | None, at: int, sibs, rep) -> tuple:
        """A new chain that is not plainly cold: held by another tier, recomputed after a removal
        (`r`), or under a parent with other cached children (`sibs`). Returns the chain with its
        mark, whose last item is how many of its blocks have the mark's reason (the rest is cold)."""
        keys = run[HDR:]
        size = ev.block_size
        toks = ev.token_ids
        if not size or len(toks) != len(keys) * size:
            toks, size = (), 0
        held = self.tier_of
        if held and keys[0] in held:
            mark = self._tier_hit(keys, held, rep)
        elif r is not None:
            mark = self._recomputed(run, r, rep, size)
        else:
            mark = self._branch(run, pr, at, toks, size, rep)
        if mark is None:
            return run
        return (*run[:MARK], mark, *run[HDR:])

    def _tier_hit(self, keys: tuple, held: dict, rep) -> tuple:
        """The first blocks of a new chain that another tier holds: loaded from it."""
        n = len(keys)
        k = 1
        while k < n and keys[k] in held:
            k += 1
        tier = held[keys[0]]
        t = self.tiers.get(tier)
        if t is not None:
            t["hits"] += k
        if rep is not None:
            rep["tiers"].setdefault(tier, {"stored": 0, "removed": 0, "hits": 0})["hits"] += k
        return ("tier", tier, k)

    def _recomputed(self, run: tuple, r: Removal, rep, size: int) -> tuple:
        """The blocks of a new chain that were stored and removed before, from its first on."""
        keys = run[HDR:]
        n = len(keys)
        reason, when, by = r.reason, r.ts, self.by_of(r)
        get = self.removed.get
        k = 1
        while k < n:
            rk = get(_ikey(keys[k]))
            if rk is None or rk.reason != reason:
                break
            if rk.ts is not None and (when is None or rk.ts > when):
                when, by = rk.ts, self.by_of(rk)
            k += 1
        if reason != "evicted":
            by = None
        if rep is not None and len(rep["recomputed"]) < MAX_DETAILS:
            d = {"session": run[USER], "reason": reason, "blocks": k, "tokens": k * size, "removed_at": when}
            if reason == "evicted":
                d["evicted_by"] = by
            rep["recomputed"].append(d)
        return ("recomputed", reason, when, by, k)

    def _tokens(self, key) -> tuple:
        """A cached block's tokens, from the mirror (() when it is not there)."""
        m = self.mirror
        s = m.key_slot.get(key)
        return () if s is None else m.tokens.get(s, ())

    def _live(self, r: tuple, i: int) -> bool:
        """The block at index i of chain `r` is cached (and was last stored in that chain)."""
        k = r[i]
        s = self.mirror.key_slot.get(k)
        return s is not None and s < len(self.chain_at) and self.chain_at[s] is r

    def chain_of(self, key) -> tuple:
        """(the chain that holds cached `key`, its index there), or (None, -1)."""
        s = self.mirror.key_slot.get(key)
        return _find(self.chain_at[s], key) if s is not None and s < len(self.chain_at) else (None, -1)

    def _siblings(self, pr: tuple | None, at: int, pk, first_token) -> list:
        """The cached chains whose first block sits where a new chain under `pk` starts, as
        (chain, index of that block), the likeliest first: the rest of the parent's own chain
        (`pr`, the parent at index `at`), then the newest chain stored under the parent (at the
        root: the newest that starts with `first_token`)."""
        live = self._live
        out = []
        if pr is not None and at + 1 < len(pr) and live(pr, at + 1):
            out.append((pr, at + 1))
        if pk is None:
            r = self.roots.get(first_token)
        else:
            ps = self.mirror.key_slot.get(pk)
            r = _head(self.heads_at, ps, pk) if ps is not None and ps < len(self.heads_at) else None
        if r is not None and r is not pr and live(r, HDR):
            out.append((r, HDR))
        return out

    def _branch(self, run: tuple, pr: tuple | None, at: int, tokens, size: int, rep) -> tuple | None:
        """The mark of a new chain that branches from a cached block with another cached child
        (the likeliest two compared): ("branch", isolated | config | diverged, at, within its first
        block, from whom, blocks); None when it has none."""
        pk = run[PARENT]
        n = len(run) - HDR
        mine = tuple(tokens[:size])
        best, sib = -1, None
        for r, i in self._siblings(pr, at, pk, tokens[0] if tokens else None):
            theirs = self._tokens(r[i])
            c = common_prefix(mine, theirs)
            if c > best:
                best, sib = c, (r, i)
        if sib is None:
            return None
        r, i = sib
        who = r[USER]
        if size and best == size:  # the same tokens under another hash: other keys
            reason = "isolated" if run[SALTED] or (i == HDR and r[SALTED]) else "config"
            k = 1
            while k < n and i + k < len(r) and self._live(r, i + k) and \
                    self._tokens(r[i + k]) == tuple(tokens[k * size:(k + 1) * size]):
                k += 1
            if rep is not None and len(rep["branches"]) < MAX_DETAILS:
                rep["branches"].append({"session": run[USER], "reason": reason, "blocks": k,
                                        "tokens": k * size, "from": who})
            return ("branch", reason, None, None, who, k)
        best = max(0, best)
        depth = run[DEPTH]
        pos = None if depth is None else depth * size + best
        if rep is not None and len(rep["branches"]) < MAX_DETAILS:
            d = {"session": run[USER], "reason": "diverged", "at": pos, "within_block": best, "blocks": n,
                 "tokens": n * size, "from": who}
            text = self._excerpt(pr, at, tokens, size, self._tokens(r[i]), best)
            if text is not None:
                d["text"] = {"prompt": text[0], "cached": text[1]}
            rep["branches"].append(d)
        return ("branch", "diverged", pos, best, who, n)

    def _excerpt(self, pr, at: int, tokens, size: int, theirs: tuple, best: int):
        """(prompt, cached): about `EXCERPT_CHARS` characters of text on each side of a branch
        point (the server's /detokenize, at most `DETOKENIZE_PER_S` calls a second), or None."""
        decode = self.detokenize
        if decode is None or not size:
            return None
        now = time.monotonic()
        second, used = self._detok_budget
        if now - second >= 1.0:
            second, used = now, 0
        if used + 3 > DETOKENIZE_PER_S:
            return None
        self._detok_budget = (second, used + 3)
        before = list(tokens[:best])
        if pr is not None and len(before) < EXCERPT_TOKENS:
            before = list(self._tokens(pr[at])) + before
        try:
            left = decode(before[-EXCERPT_TOKENS:])[-EXCERPT_CHARS:] if before else ""
            mine = decode(list(tokens[best:min(size, best + EXCERPT_TOKENS)]))[:EXCERPT_CHARS]
            other = decode(list(theirs[best:best + EXCERPT_TOKENS]))[:EXCERPT_CHARS]
        except Exception:  # a server that cannot decode: no text
            return None
        if not (left or mine or other):
            return None
        return left + mine, left + other

    # --- memory -----------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Drop the roots whose first block is no longer cached (or was stored again by another
        chain): with the slots' chains, memory follows the pool."""
        live = self._live  # (in place: a new dict would be young, and each young collection walks it)
        for t in [t for t, r in self.roots.items() if not live(r, HDR)]:
            del self.roots[t]

    # --- what views read ----------------------------------------------------------------------
    def marks(self) -> dict:
        """{key: mark} of the cached chains' first blocks that have one, for the prefix tree:
        `{"kind": "diverged", "at", "within_block", "from", "blocks"}` (a branch: `at` the first
        differing token, None when the chain's depth is not known), `{"kind": "isolated" |
        "config", "from", "blocks"}` (the same tokens as a sibling, under other keys), or
        `{"kind": "recomputed", "reason": "evicted" | "cleared" | "config", "removed_at",
        "evicted_by", "blocks"}` (stored, removed, and stored again). Read off the slots' chains:
        a chain's mark is its first block's while that block is cached (a tier hit is none)."""
        out = {}
        slot_of = self.mirror.key_slot.get
        chain_at = self.chain_at
        for s, r in enumerate(chain_at):
            if r is None or r[MARK] is None or r[MARK][0] == "tier" or slot_of(r[HDR]) != s:
                continue  # (each chain once: at its first block's slot, while it holds it)
            m = r[MARK]
            if m[0] == "recomputed":
                d = {"kind": "recomputed", "reason": m[1], "removed_at": m[2], "evicted_by": m[3], "blocks": m[4]}
            elif m[1] == "diverged":
                d = {"kind": "diverged", "at": m[2], "within_block": m[3], "from": m[4], "blocks": m[5]}
            else:
                d = {"kind": m[1], "from": m[4], "blocks": m[5]}
            out[r[HDR]] = d
        return out

    def summary(self) -> dict:
        c = self.counts
        return {"blocks": dict(c["blocks"]), "tokens": dict(c["tokens"]),
                "by_session": {s: {"blocks": {k: v for k, v in zip(COUNTED, c) if v},
                                   "tokens": {k: v for k, v in zip(COUNTED, c[_NC:]) if v}}
                               for s, c in sorted(self.sessions.items()) if any(c[:_NC])},
                "evicted_from": dict(self.evicted_from.most_common(64)),
                "tiers": {t: dict(v) for t, v in sorted(self.tiers.items())},
                "memory": {"removed_recent": len(self.removed.recent), "removed_recent_bytes": self.removed.recent_nbytes,
                           "removed_filter_bytes": self.removed.nbytes,
                           "false_positive_bound": self.removed.false_positive_bound,
                           "chain_slots": len(self.chain_at), "roots": len(self.roots),
                           "tier_keys": len(self.tier_of)}}

    # --- attach: a whole prompt --------------------------------------------------------------
    def _track(self, ev, keys: list, pk, tokens: list, size: int) -> None:
        """Feed the MissTracker (engine/miss.py) the new blocks: by slot id, their parent's, their
        tokens, and their keys: (0, the chain's extra keys) (a salt sits on a chain's first block)."""
        tr = self.tracker
        m = self.mirror
        ids = ev.block_ids
        if len(ids) != len(keys) or not size:
            return
        slot = None if pk is None else m.key_slot.get(pk)
        parent = None if slot is None else slot + m.offset
        if pk is not None and parent is None:
            return  # its parent is not cached: the tracker indexes no orphan
        info = None if parent is None else tr.live.get(parent)
        sig = (0, info[1][1] if info is not None else None)
        extras = ev.extra_keys
        for i, b in enumerate(ids):
            x = extras[i] if extras and i < len(extras) else None
            if x is not None:
                sig = (0, frozen_extra(x))
            tr.stored(b, parent, tuple(tokens[i * size:(i + 1) * size]), sig)
            parent = b

    def explain_prompt(self, token_ids: list, keys: list, cached_tokens: int, block_size: int,
                       salt=None) -> dict | None:
        """The miss object (engine/miss.py) of a prompt the server served with `cached_tokens`
        from its cache, after the fact: `keys` are the mirror keys of its full blocks as the
        mirror holds them now (the prompt's own stored blocks among them; fewer when they are
        not all there). Its uncached blocks are explained against what was cached and removed
        before: its own blocks do not count as cached. None when the mirror cannot tell (no
        tracker, a cached prefix the mirror does not hold, or no block size)."""
        tr = self.tracker
        bs = block_size
        n = len(token_ids)
        if tr is None or bs <= 0 or cached_tokens > n:
            return None
        j = cached_tokens // bs
        limit = max(0, (n - 1) // bs)
        m = self.mirror
        slots = [m.key_slot.get(k) for k in keys]
        if j > len(keys) or any(s is None for s in slots[:j]):
            return None
        off = m.offset
        ids = [s + off for s in slots if s is not None]
        own = set(ids[j:])
        matched = ids[:j]
        hashes = _ikeys(list(keys[:limit])) + [-1 - k for k in range(len(keys), limit)]
        live = tr.live

        def sig_for(k: int):
            if k < len(ids) and ids[k] in live:
                return live[ids[k]][1]
            return (0, salt)

        tr.bs = bs
        pool = MirrorPool(m, self, own)
        miss = tr.explain(pool, list(token_ids), hashes, limit, matched, sig_for, n)
        if cached_tokens % bs and miss["spans"]:  # (a server that hits part of a block)
            spans = miss["spans"]
            cut = cached_tokens - j * bs
            spans[0][0] += cut
            spans[0][1] -= cut
            miss = miss_object([s for s in spans if s[1] > 0], miss["diverged_at"],
                               (miss["excerpt"]["prompt"], miss["excerpt"]["cached"]) if miss["excerpt"] else None,
                               miss["evicted_at"], miss["eviction_policy"], miss["cleared_at"])
        return miss


class _BlockInfo:
    __slots__ = ("creator", "created_seq")

    def __init__(self, creator, created_seq):
        self.creator, self.created_seq = creator, created_seq


class _Index:
    """`pool.index` of a MirrorPool: hash (as the RemovedLog's int) -> block id of the blocks
    cached before the prompt came (its own blocks excluded)."""

    def __init__(self, pool: "MirrorPool"):
        self._pool = pool

    def get(self, ikey, default=None):
        return self._pool.id_of.get(ikey, default)


class MirrorPool:
    """What engine/miss.py's `MissTracker.explain` reads from a pool (`index`, `blocks[b].creator`
    and `.created_seq`, `token_ids(b)`, `children`), over a Mirror and its PodMisses, for a
    prompt whose own new blocks (`own`, block ids) are in the mirror already: they do not count."""

    def __init__(self, mirror, misses: PodMisses, own: set):
        self.m, self.misses, self.own = mirror, misses, own
        off = mirror.offset
        self.id_of = {}
        for key, s in mirror.key_slot.items():
            b = s + off
            if b not in own:
                self.id_of[key if key.__class__ is int else hash(key)] = b
        self.index = _Index(self)
        self.blocks = _Blocks(self)
        self.children = _Children(self)

    def token_ids(self, b: int) -> tuple:
        if b in self.own:
            return ()
        return self.m.tokens.get(b - self.m.offset, ())


class _Blocks:
    def __init__(self, pool: MirrorPool):
        self._pool = pool

    def __getitem__(self, b: int) -> _BlockInfo:
        m = self._pool.m
        s = b - m.offset
        c = int(m.creator[s]) if 0 <= s < len(m.creator) else -1
        return _BlockInfo(m.users[c] if c >= 0 else None, float(m.created_at[s]) if 0 <= s < len(m.created_at) else 0.0)


class _Children:
    """`pool.children.get(parent id)`: the cached children of a block (a set of ids), from the
    PodMisses' chains."""

    def __init__(self, pool: MirrorPool):
        self._pool = pool

    def get(self, b: int, default=None):
        p = self._pool
        m = p.m
        key = m.key.get(b - m.offset)
        if key is None:
            return default
        pm = p.misses
        out = set()
        pr, at = pm.chain_of(key)
        for r, i in pm._siblings(pr, at, key, None):
            s = m.key_slot.get(r[i])
            if s is not None and s + m.offset not in p.own:
                out.add(s + m.offset)
        return out or default


def recorded_marks(batches: list, n: int) -> dict:
    """The prefix tree's marks (`PodMisses.marks`) of a recorded session after its first `n`
    events: its batches applied to a Mirror of their own and attributed, as they came."""
    m = Mirror()
    pm = PodMisses(m)
    done = 0
    for b in batches:
        if done >= n:
            break
        k = min(len(b.events), n - done)
        part = b if k == len(b.events) else ev_.EngineBatch(b.step, b.ts, b.events[:k], b.forwards, b.pod, b.wire_seq)
        m.apply(part)
        pm.apply(part)
        done += k
    return pm.marks()


class MissWatch:
    """The PodMisses of a fleet's pods (made on a pod's first batch): what `kvplay watch`,
    attach and the prefix tree read."""

    def __init__(self, fleet, explain: bool = False, detokenize: Callable | None = None):
        self.fleet = fleet
        self.explain = explain
        self.detokenize = detokenize
        self.pods: dict[str, PodMisses] = {}
        self.seconds: dict[str, float] = {}  # pod -> seconds spent attributing its batches

    def pod(self, name: str) -> PodMisses:
        pm = self.pods.get(name)
        if pm is None:
            pm = self.pods[name] = PodMisses(self.fleet.pod(name), self.explain, self.detokenize)
        return pm

    def on_batch(self, pod: str, batch: ev_.EngineBatch, detail: bool = False) -> dict | None:
        pm = self.pod(pod)  # (made on the first batch: its compiled loop loaded, or built, outside the cost)
        t = time.perf_counter()
        try:
            return pm.apply(batch, detail)
        finally:
            self.seconds[pod] = self.seconds.get(pod, 0.0) + time.perf_counter() - t

    def summary(self) -> dict:
        return {name: pm.summary() for name, pm in self.pods.items()}
