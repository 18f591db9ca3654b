"""Why a prompt token was computed: the miss reasons, the bounded memory of removed blocks, and
the attribution the KV manager makes when it admits a request (kv_manager.py).

**The reasons.** At a request's first admission every prompt token that is not served from the
cache gets exactly one reason, so the counts sum to ``prompt_tokens - cached_tokens``:

- ``tail``: the tokens after the last reusable full block: the partial last block (never stored)
  and, when the prompt ends on a block boundary, the block holding the last token (kvplay, like
  vLLM, always computes it: its logits start the answer).
- each full block from the first missed block on, by its own history, in this order:

  0. its hash is cached but unreachable because an earlier block broke the chain: that block's
     reason (only after a ``collision``: a reachable hash's ancestors are always cached);
  1. its hash, under this request's keys, was stored and removed: ``evicted`` (when, under which
     policy, and whose request's allocation pushed it out: ``evicted_by``), ``cleared`` (F4, an
     admin reset, ``AllBlocksCleared``) or ``config`` (a reconfigure that needed a fresh cache:
     hash, seed or determinism; remembered by content too, since the new hash cannot match);
  2. a cached block with the same token chain but other keys exists: ``isolated`` when only the
     salt differs (``isolated_from``: whose), ``config`` when other keys differ;
  3. it is the first missed block and a cached block under the same keys at the same chain
     position (a child of the last matched block, or a root when none matched) starts with the
     same token: ``diverged`` (``diverged_at``: the first differing prompt position, with a short
     decoded excerpt of both sides); after a matched prefix, any cached child under the same
     keys counts, even one that differs from its first token (a breaker that falls on a block
     boundary: ``diverged_at`` is then the boundary); a first block that shares no token with
     any root is ``cold``, not diverged. Later blocks that are none of 0-2 are ``diverged`` too;
  4. else ``cold``: no block with this content was ever stored (that kvplay remembers).

- ``collision``: the first missed block's hash is cached but verify-on-hit found other tokens
  (a caught hash collision; with ``--no-verify`` the engine would have served it).

**Bounded memory.** What was stored and removed lives in a ``RemovedLog``: a recent map of at
least the last ``recent`` removals with their details (16,384 by default, at most 4,096 more:
a dict of about 5 MiB at most here, less where removals share their details; the watch side's
is compiled, wire/csrc/recent_map.h, 0.63-0.74 MiB), and behind it, per reason, a
rotating pair of blocked Bloom filters that remember at least the next ``bloom_capacity``
(131,072) removals without details (then ``evicted_by`` says "?"). Each filter has 24 bits per
item and 12 probes, all in one 64-byte block: a false positive rate of about 5.1e-5 per filter
when full, so a never-stored block is reported as removed with probability about 3.1e-4 (two
generations, three reasons; ``RemovedLog.false_positive_bound``; tests measure it on random and
sequential keys); the filters cost 2.25 MiB when all six exist (each is made on its first use). The content index behind ``isolated``,
``diverged`` and ``config`` holds only blocks that are cached now (bounded by the pool).

**Cost.** An admission looks at O(1) blocks in the common cases: the store/removal checks and
the content check are closed under prefixes (a block can only have been stored if its parent
was), so once a check fails for one block it is not made again for the blocks after it; the
sibling search compares at most ``MAX_SIBLINGS`` blocks. Stores and removals cost O(1) each.

The miss object (``RequestStats.miss``, ``MissExplained``, ``kvplay run --json``) is plain data:
``miss_object`` builds it from spans, ``redact`` makes the view another tenant may see.
"""
from __future__ import annotations

import math
import sys
from itertools import islice
from operator import itemgetter
from typing import Callable, NamedTuple

import numpy as np

from kvplay.inert import inert

REASONS = ("cold", "evicted", "isolated", "diverged", "tail", "cleared", "config", "collision")
# the pool's removal reasons (BlockRemoved.reason, AllBlocksCleared.reason) -> miss reasons
REMOVAL_REASONS = {"evicted": "evicted", "cleared": "cleared", "reconfigured": "config"}
MAX_SIBLINGS = 32  # blocks compared token by token when looking for a divergence point
EXCERPT_TOKENS = 8  # tokens decoded on each side of a divergence point
EXCERPT_CHARS = 16  # characters kept on each side of it
_ROOT = 0x6B76706C6179  # the content chain's root ("kvplay")
_MASK = (1 << 64) - 1


# --- the bounded memory of removed blocks --------------------------------------------------------
_C1, _C2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F  # odd 64-bit multipliers (golden ratio; xxHash's)
_U_C1, _U_32 = np.uint64(_C1), np.uint64(32)


_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer
_U_M1, _U_M2, _U_C2 = np.uint64(_M1), np.uint64(_M2), np.uint64(_C2)
MAX_PROBES = 14  # 9 bits each from two 64-bit hashes


def _mix(z: int) -> int:
    """splitmix64's finalizer: every bit of the result depends on every bit of z."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _probe_hashes(key: int) -> tuple[int, int, int]:
    """A key's probe hashes (h, u, v): h the high 32 bits of key x C1 modulo 2^64 (its block),
    u and v two mixed 64-bit hashes of the key (its bits in the block, 9 bits each)."""
    x = key & _MASK
    return ((x * _C1) & _MASK) >> 32, _mix(x), _mix(x ^ _C2)


def _np_mix(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z *= _U_M1
    z ^= z >> np.uint64(27)
    z *= _U_M2
    z ^= z >> np.uint64(31)
    return z


BLOCK_BITS = 512  # a key's probes all fall in one block of this many bits: one 64-byte cache line


class RotatingBloom:
    """A Bloom filter in two generations: items go into the current one; once it holds
    `capacity` items it becomes the previous one and the old previous one is forgotten. So it
    remembers at least the last `capacity` items (at most 2x), in 2 x `capacity` x
    `bits_per_item` bits (rounded up to whole blocks), with a false positive rate of at most
    `false_positive_bound`.

    Blocked: all probes of a key fall in one block of `BLOCK_BITS` bits (a cache line, so adding
    or checking a key touches one line per generation, not one per probe). With the key's probe
    hashes (h, u, v) (`_probe_hashes`), its block is h mod blocks, and probe i is the bit of the
    block that bits 9i.. of u name (i < 7), then those of v (at most `MAX_PROBES`). Keys are ints,
    taken modulo 2^64."""

    def __init__(self, capacity: int = 1 << 17, bits_per_item: int = 24, probes: int = 12):
        if capacity < 1 or bits_per_item < 1 or probes < 1:
            raise ValueError("capacity, bits_per_item and probes must be positive")
        if probes > MAX_PROBES:
            raise ValueError(f"at most {MAX_PROBES} probes")
        self.capacity, self.probes = capacity, probes
        self.m = self.size(capacity, bits_per_item)  # bits per generation
        self.blocks = self.m // BLOCK_BITS
        self._cur = np.zeros(self.m // 8, dtype=np.uint8)
        self._prev = np.zeros(self.m // 8, dtype=np.uint8)
        self._vcur, self._vprev = memoryview(self._cur), memoryview(self._prev)  # bytes read as ints
        self._n = 0  # items in the current generation
        self._n_prev = 0
        self._shifts = [(i // 7, 9 * (i % 7)) for i in range(probes)]  # (u or v, bit) of each probe

    @property
    def nbytes(self) -> int:
        return self._cur.nbytes + self._prev.nbytes

    def __len__(self) -> int:
        """Items remembered (both generations; re-added items count again)."""
        return self._n + self._n_prev

    @staticmethod
    def filter_rate(n: int, m: int, k: int) -> float:
        """The false positive rate of one blocked filter of m bits holding n items with k probes:
        a block holds j items with the Poisson probability of mean n x 512 / m, and each of
        their k probes leaves a given bit of it clear with probability 1 - 1/512; a never-added
        key is reported when its k bits are all set: the sum over j of P(j) (1 - (1 - 1/512)^kj)^k."""
        lam = n * BLOCK_BITS / m
        p = math.exp(-lam)
        total, j = 0.0, 0
        while j < lam + 12 * math.sqrt(lam) + 20:
            total += p * (1.0 - (1.0 - 1.0 / BLOCK_BITS) ** (k * j)) ** k
            j += 1
            p *= lam / j
        return total

    @staticmethod
    def size(capacity: int, bits_per_item: int) -> int:
        """Bits per generation of a filter of `capacity` items of `bits_per_item` bits."""
        return -(-capacity * bits_per_item // BLOCK_BITS) * BLOCK_BITS

    @property
    def false_positive_bound(self) -> float:
        """At most this share of never-added keys is reported as added (both generations full)."""
        return 2 * self.filter_rate(self.capacity, self.m, self.probes)

    def _positions(self, keys: list[int]) -> np.ndarray:
        try:  # a server's hashes: ints in [0, 2^64), converted at C speed
            x = np.array(keys, dtype=np.uint64)
        except (OverflowError, TypeError, ValueError):
            x = np.fromiter(map(_MASK.__and__, keys), dtype=np.uint64, count=len(keys))
        h = x * _U_C1  # uint64 arithmetic wraps: mod 2^64
        h >>= _U_32
        base = (h.view(np.int64) % self.blocks) * BLOCK_BITS  # (h below 2^32)
        uv = (_np_mix(x), _np_mix(x ^ _U_C2))
        mask = np.uint64(BLOCK_BITS - 1)
        pos = np.empty((len(x), self.probes), dtype=np.int64)
        for i, (w, shift) in enumerate(self._shifts):
            pos[:, i] = ((uv[w] >> np.uint64(shift)) & mask).view(np.int64)
        pos += base[:, None]
        return pos.ravel()

    def add_many(self, keys: list[int]) -> None:
        start = 0
        while start < len(keys):
            if self._n >= self.capacity:
                self.rotate()
            part = keys[start:start + self.capacity - self._n]
            pos = self._positions(part)
            idx, bits = pos >> 3, np.left_shift(1, pos & 7).astype(np.uint8)
            cur = self._cur
            cur[idx] |= bits  # buffered: of two probes into one byte only one may stick ...
            lost = (cur[idx] & bits) != bits
            if lost.any():  # ... so those are set again, unbuffered
                np.bitwise_or.at(cur, idx[lost], bits[lost])
            self._n += len(part)
            start += len(part)

    def rotate(self) -> None:
        """The current generation becomes the previous one; the old previous one is forgotten."""
        self._prev, self._cur = self._cur, self._prev
        self._vprev, self._vcur = self._vcur, self._vprev
        self._cur[:] = 0
        self._n_prev, self._n = self._n, 0

    def has(self, h: int, u: int, v: int) -> bool:
        """Whether a key whose probe hashes are (h, u, v) (`_probe_hashes`) was added (or is a
        false positive)."""
        base = (h % self.blocks) * BLOCK_BITS
        uv = (u, v)
        bits = [base + ((uv[w] >> shift) & (BLOCK_BITS - 1)) for w, shift in self._shifts]
        return (bool(self._n) and self._all(self._vcur, bits)) or (bool(self._n_prev) and self._all(self._vprev, bits))

    @staticmethod
    def _all(v, bits: list) -> bool:
        """Whether all of `bits` are set in one generation's bytes `v`."""
        for p in bits:
            if not v[p >> 3] >> (p & 7) & 1:
                return False
        return True

    def __contains__(self, key: int) -> bool:
        if not self._n and not self._n_prev:
            return False
        return self.has(*_probe_hashes(key))


class Removal(NamedTuple):
    """One remembered removal: its miss reason (evicted | cleared | config), and, while it is in
    the recent map, when, under which policy, by whose allocation, and who created the block
    (None once only a Bloom filter remembers it)."""
    reason: str
    ts: float | None = None
    policy: str = ""
    by: str | None = None  # the user whose request's allocation evicted it
    creator: str | None = None


_REMOVAL_KINDS = ("evicted", "cleared", "config")
_reason_of = itemgetter(0)  # a Removal's reason


class RemovedLog:
    """Keys (block hashes, or content keys; ints) that were stored and removed, with why: at
    least the last `recent` with their details in a map (at most `recent` + `flush_every`: the
    oldest leave it `flush_every` at a time), older ones in a RotatingBloom per reason.

    The map is a dict, or what `recent_map(capacity)` makes: the watch side's compiled one
    (wire/csrc/recent_map.h: a dict's behaviour for int keys, in generations of a quarter of
    its capacity with a small index and filter each, where a dict of that churn costs ~5 cache
    misses a removal)."""

    def __init__(self, recent: int = 16384, bloom_capacity: int = 1 << 17, bits_per_item: int = 24,
                 probes: int = 12, flush_every: int = 4096, flusher: Callable | None = None,
                 filterer: Callable | None = None, recent_map: Callable | None = None):
        self.recent_capacity = recent
        # flush compiled (wire/miss_native.py): flusher(self), the same result; it reads the
        # compiled map in place, so it goes with it (a dict is flushed here)
        self._flusher = flusher if recent_map is not None else None
        self._filterer = filterer  # `filtered` compiled: filterer(self, key), the same result
        self._bloom_args = (bloom_capacity, bits_per_item, probes)
        self._flush_every = max(1, flush_every)
        # key -> Removal, insertion-ordered: the oldest first
        self.recent = {} if recent_map is None else recent_map(recent + self._flush_every)
        self.blooms: dict[str, RotatingBloom] = {}  # reason -> filter, made on first use
        self._filters: list = []  # (reason, filter) of the filters made, in _REMOVAL_KINDS' order

    def add(self, key: int, removal: Removal) -> None:
        rec = self.recent
        if key in rec:
            del rec[key]  # removed again: it moves to the end
        rec[key] = removal
        if len(rec) >= self.recent_capacity + self._flush_every:
            self.flush()

    def add_many(self, keys, removals) -> None:
        """`add` for parallel iterables of keys and removals, at C speed; a key already in the
        recent map keeps its place there (its details are replaced)."""
        rec = self.recent
        rec.update(zip(keys, removals))
        if len(rec) >= self.recent_capacity + self._flush_every:
            self.flush()

    def add_all(self, keys, removal: Removal) -> None:
        """`add_many` of one removal for all `keys`."""
        rec = self.recent
        for k in keys:
            rec[k] = removal
        if len(rec) >= self.recent_capacity + self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Move the oldest removals beyond `recent` from the map into the filters."""
        if self._flusher is not None:
            self._flusher(self)
            return
        rec = self.recent
        n = len(rec) - self.recent_capacity
        if n <= 0:
            return
        old = list(islice(rec, n))
        reasons = list(map(_reason_of, map(rec.pop, old)))
        kinds = set(reasons)
        for reason in kinds:
            keys = old if len(kinds) == 1 else [k for k, r in zip(old, reasons) if r == reason]
            self.bloom_for(reason).add_many(keys)

    def bloom_for(self, reason: str) -> RotatingBloom:
        """The filter of `reason`, made on first use."""
        bloom = self.blooms.get(reason)
        if bloom is None:
            bloom = self.blooms[reason] = RotatingBloom(*self._bloom_args)
        return bloom

    def get(self, key: int) -> Removal | None:
        r = self.recent.get(key)
        if r is not None or not self.blooms:
            return r
        return self.filtered(key)

    def filtered(self, key: int) -> Removal | None:
        """`get` for a key that is not in the recent map: what the filters say (the reason only)."""
        if self._filterer is not None:
            return self._filterer(self, key)
        filters = self._filters
        if len(filters) != len(self.blooms):
            filters = self._filters = [(r, self.blooms[r]) for r in _REMOVAL_KINDS if r in self.blooms]
        h = _probe_hashes(key)
        for reason, bloom in filters:
            if bloom.has(*h):
                return Removal(reason)
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of the Bloom filters made so far (the recent map holds at most `recent_capacity`
        + `flush_every` entries of about 100 bytes each, the removals' details shared)."""
        return sum(b.nbytes for b in self.blooms.values())

    @property
    def recent_nbytes(self) -> int:
        """Bytes of the recent map's tables (a compiled map's generations; a dict's table, not
        the removals it points at)."""
        nbytes = getattr(self.recent, "nbytes", None)
        return nbytes if nbytes is not None else sys.getsizeof(self.recent)

    @property
    def false_positive_bound(self) -> float:
        """At most this share of never-removed keys is reported removed (every filter full)."""
        cap, bits, k = self._bloom_args
        return 3 * 2 * RotatingBloom.filter_rate(cap, RotatingBloom.size(cap, bits), k)


# --- the miss object -------------------------------------------------------------------------
Span = list  # [start, tokens, reason, who, by]: `who` the user whose block is the evidence
#             (evicted/cleared/config/collision: its creator; isolated: the other salt's creator;
#             diverged: the sibling's creator), `by` the evicting user ("" when none)


def empty_reasons() -> dict[str, int]:
    return dict.fromkeys(REASONS, 0)


def miss_object(spans: list, diverged_at: int | None = None, excerpt: tuple[str, str] | None = None,
                evicted_at: float | None = None, eviction_policy: str | None = None,
                cleared_at: float | None = None, own_keys: bool = False) -> dict:
    """The miss object (JSON-ready) from its spans and details: tokens, reasons (all eight),
    diverged_at and excerpt, evicted_by / isolated_from (user -> tokens), times, and the spans;
    `"own_keys": true` when it was explained from the sender's own keys only (docs/miss.md,
    "Across keys"): its cold tokens may be held under another key."""
    reasons = empty_reasons()
    evicted_by: dict[str, int] = {}
    isolated_from: dict[str, int] = {}
    diverged_from = None
    clean = []
    for sp in spans:
        start, n, reason, who, by = sp
        if reason not in reasons or n <= 0:  # (a damaged recording: never a traceback)
            continue
        reasons[reason] += n
        if reason == "evicted":
            evicted_by[by or "?"] = evicted_by.get(by or "?", 0) + n
        elif reason == "isolated":
            isolated_from[who or "?"] = isolated_from.get(who or "?", 0) + n
        elif reason == "diverged" and diverged_from is None:
            diverged_from = who or None
        clean.append([start, n, reason, who, by])
    has_div = reasons["diverged"] > 0
    return {
        "tokens": sum(reasons.values()), "reasons": reasons,
        "diverged_at": diverged_at if has_div else None, "diverged_from": diverged_from if has_div else None,
        "excerpt": {"prompt": excerpt[0], "cached": excerpt[1]} if has_div and excerpt else None,
        "evicted_by": evicted_by, "evicted_at": evicted_at if reasons["evicted"] else None,
        "eviction_policy": (eviction_policy or None) if reasons["evicted"] else None,
        "isolated_from": isolated_from, "cleared_at": cleared_at if reasons["cleared"] else None,
        "spans": clean,
    } | ({"own_keys": True} if own_keys else {})


def miss_from_event(e) -> dict:
    """The miss object of a MissExplained event (or its recorded dict)."""
    get = e.get if isinstance(e, dict) else lambda k, d=None: getattr(e, k, d)
    ex_p, ex_c = get("excerpt_prompt", "") or "", get("excerpt_cached", "") or ""
    return miss_object([list(s) for s in get("spans", []) or []], get("diverged_at"),
                       (ex_p, ex_c) if ex_p or ex_c else None, get("evicted_at"), get("eviction_policy") or None,
                       get("cleared_at"), get("own_keys") is True)


def same_reasons(a: dict | None, b: dict | None) -> bool:
    """Two miss objects give the same reasons (counts per reason, and where it diverged)."""
    if a is None or b is None:
        return a is b
    return a.get("reasons") == b.get("reasons") and a.get("diverged_at") == b.get("diverged_at")


def redact(miss: dict | None, user: str) -> dict | None:
    """The miss object as `user` may see it on a server shared with other tenants: tokens whose
    reason rests on another user's block (evicted, cleared, config, collision, diverged: that
    someone else stored these tokens is itself what isolation hides) and every `isolated` token
    (it says another tenant holds the same tokens) count as `cold`; evictions by other users
    say "others"; another user's text never appears in an excerpt."""
    if miss is None:
        return None
    spans = []
    for start, n, reason, who, by in miss.get("spans") or []:
        if reason == "isolated" or (reason not in ("cold", "tail") and who not in ("", user)):
            reason, who, by = "cold", "", ""
        elif reason == "evicted" and by != user:
            by = "others"
        spans.append([start, n, reason, who, by])
    ex = miss.get("excerpt")
    return miss_object(spans, miss.get("diverged_at"), (ex["prompt"], ex["cached"]) if ex else None,
                       miss.get("evicted_at"), miss.get("eviction_policy"), miss.get("cleared_at"))


def miss_text(miss: dict | None, user: str | None = None, limit: int = 3) -> str:
    """`42: 26 diverged at 497, 16 tail` (the biggest reasons first, the tail last); `10 (tail)`
    when only the tail was computed; "" without a miss object. `user`: names it as "own"."""
    if not miss:
        return ""
    r = miss.get("reasons") or {}
    total = miss.get("tokens", sum(r.values()))
    parts = [(k, n) for k, n in sorted(r.items(), key=lambda kv: -kv[1]) if n and k != "tail"]
    if not parts:
        return f"{total} (tail)"

    def label(k: str) -> str:
        if k == "diverged" and miss.get("diverged_at") is not None:
            return f"diverged at {miss['diverged_at']}"
        names = miss.get("evicted_by" if k == "evicted" else "isolated_from" if k == "isolated" else "") or {}
        if len(names) == 1:
            who = next(iter(names))
            return f"{k} {'by' if k == 'evicted' else 'from'} {'own' if who == user else inert(who, limit=64)}"
        return k

    shown = [f"{n} {label(k)}" for k, n in parts[:limit]]
    rest = sum(n for _, n in parts[limit:])
    if rest:
        shown.append(f"{rest} other")
    if r.get("tail"):
        shown.append(f"{r['tail']} tail")
    return f"{total}: " + ", ".join(shown)


# --- the attribution --------------------------------------------------------------------------
def _add(index: dict, key, bid: int) -> None:
    cur = index.get(key)
    if cur is None:
        index[key] = bid
    elif isinstance(cur, set):
        cur.add(bid)
    elif cur != bid:
        index[key] = {cur, bid}


def _drop(index: dict, key, bid: int) -> None:
    cur = index.get(key)
    if cur == bid:
        del index[key]
    elif isinstance(cur, set):
        cur.discard(bid)
        if len(cur) == 1:
            index[key] = next(iter(cur))
        elif not cur:
            del index[key]


def _members(index: dict, key, cap: int) -> list[int]:
    cur = index.get(key)
    if cur is None:
        return []
    if isinstance(cur, set):
        out = []
        for b in cur:
            out.append(b)
            if len(out) >= cap:
                break
        return out
    return [cur]


def content_key(parent: int, tokens: tuple) -> int:
    """A block's content chain key: its tokens and its ancestors' tokens, no extra keys (so a
    block under another salt, model key or hash has the same one). 64 bits, in memory only."""
    return hash((parent, tokens))


class MissTracker:
    """Everything the attribution needs, kept up to date by the KV manager (stores) and the pool
    (removals): the cached blocks by content chain and by (parent, keys, first token), and the
    RemovedLogs. `sig` is what a block's hash was made under besides its tokens: (cache
    generation, salt) in kvplay's engine."""

    def __init__(self, block_size: int, decode: Callable[[list[int]], str] | None = None,
                 removed: RemovedLog | None = None, reconfigured: RemovedLog | None = None):
        self.bs = block_size
        self.decode = decode
        self.removed = removed or RemovedLog()
        self.reconfigured = reconfigured or RemovedLog(recent=4096, bloom_capacity=1 << 15)
        self.live: dict[int, tuple] = {}  # block id -> (content key, sig, kids key)
        self.by_content: dict[int, int | set] = {}
        self.kids: dict[tuple, int | set] = {}  # (parent id or -1, sig, first token) -> block ids

    # --- kept up to date -----------------------------------------------------------------------
    def stored(self, bid: int, parent: int | None, tokens: tuple, sig) -> None:
        """Block `bid` entered the prefix index holding `tokens` under `sig`."""
        if parent is None:
            pck = _ROOT
        else:
            info = self.live.get(parent)
            if info is None:  # the pool indexes a block only under an indexed parent
                return
            pck = info[0]
        ck = content_key(pck, tokens)
        kk = (-1 if parent is None else parent, sig, tokens[0] if tokens else None)
        old = self.live.get(bid)
        if old is not None:
            self._forget(bid, old)
        self.live[bid] = (ck, sig, kk)
        _add(self.by_content, ck, bid)
        _add(self.kids, kk, bid)

    def _forget(self, bid: int, info: tuple) -> None:
        _drop(self.by_content, info[0], bid)
        _drop(self.kids, info[2], bid)

    def removed_blocks(self, items: list, reason: str, ts: float, by: str | None, policy: str) -> None:
        """Blocks left the prefix index: `items` are (hash, block id, creator); `reason` the
        pool's (evicted | cleared | reconfigured | a watched server's)."""
        miss_reason = REMOVAL_REASONS.get(reason, "cleared")
        log = self.removed
        for h, bid, creator in items:
            info = self.live.pop(bid, None)
            if info is not None:
                self._forget(bid, info)
            r = Removal(miss_reason, ts, policy if miss_reason == "evicted" else "",
                        by if miss_reason == "evicted" else None, creator or None)
            log.add(h, r)
            if miss_reason == "config" and info is not None:
                self.reconfigured.add(info[0], r)

    def clear(self) -> None:
        """Forget the cached blocks (not what was removed): the pool forgot them too."""
        self.live.clear()
        self.by_content.clear()
        self.kids.clear()

    # --- the attribution -----------------------------------------------------------------------
    def explain(self, pool, tokens: list[int], hashes: list[int], limit: int, matched: list[int],
                sig_for: Callable[[int], object], n_prompt: int, across_keys: bool = True) -> dict:
        """The miss object of a request at its first admission: `tokens` its prompt, `hashes` its
        block hashes, `limit` its reusable full blocks, `matched` the cached blocks it got,
        `sig_for(k)` the keys of its block k. Without `across_keys` only what was stored under
        the request's own keys is consulted (its own hashes, its siblings): no content lookup
        (isolated, and config by content), whose length would follow another tenant's prefix."""
        bs = self.bs
        j = len(matched)
        spans: list[list] = []

        def add(start: int, n: int, reason: str, who: str = "", by: str = "") -> None:
            if spans:
                last = spans[-1]
                if last[2] == reason and last[3] == who and last[4] == by and last[0] + last[1] == start:
                    last[1] += n
                    return
            spans.append([start, n, reason, who, by])

        blocks = pool.blocks
        diverged_at = excerpt = evicted_at = policy = cleared_at = None
        brk = None  # the first missed block's (reason, who, by)
        stored_ok = reconf_ok = content_ok = True
        if matched:
            info = self.live.get(matched[-1])
            ck = info[0] if info is not None else None
        else:
            ck = _ROOT
        if ck is None or not across_keys:  # (ck None cannot happen: a matched block is cached)
            reconf_ok = content_ok = False
        k = j
        while k < limit:
            start = k * bs
            blk = pool.index.get(hashes[k])
            if blk is not None:  # (0) cached but not served: a caught collision, or after one
                if brk is None:
                    brk = ("collision", blocks[blk].creator or "", "")
                add(start, bs, *brk)
                k += 1
                if ck is not None:
                    ck = content_key(ck, tuple(tokens[start:start + bs]))
                continue
            found = None
            if stored_ok:  # (1) its own hash was stored and removed
                r = self.removed.get(hashes[k])
                if r is not None:
                    found = (r.reason, r.creator or "", (r.by or "?") if r.reason == "evicted" else "")
                    if r.ts is not None:
                        if r.reason == "evicted" and (evicted_at is None or r.ts > evicted_at):
                            evicted_at, policy = r.ts, r.policy
                        elif r.reason == "cleared" and (cleared_at is None or r.ts > cleared_at):
                            cleared_at = r.ts
                else:
                    stored_ok = False
            if ck is not None and (reconf_ok or content_ok):
                ck = content_key(ck, tuple(tokens[start:start + bs]))
            if found is None and reconf_ok:  # (1) its content was removed by a reconfigure
                r = self.reconfigured.get(ck)
                if r is not None:
                    found = ("config", r.creator or "", "")
                else:
                    reconf_ok = False
            if found is None and content_ok:  # (2) the same content under other keys
                sig = sig_for(k)
                cands = [b for b in _members(self.by_content, ck, MAX_SIBLINGS) if self.live[b][1] != sig]
                if cands:
                    iso = [b for b in cands if _only_salt_differs(self.live[b][1], sig)]
                    b = min(iso or cands, key=lambda b: blocks[b].created_seq)  # the first to store it
                    found = ("isolated" if iso else "config", blocks[b].creator or "", "")
                else:
                    content_ok = False
            if found is None and k == j:  # (3) a sibling under the same keys starts the same
                parent = matched[-1] if matched else -1
                sig = sig_for(k)
                best, who, sib = self._sibling(pool, tokens[start:start + bs], (parent, sig, tokens[start]))
                if sib < 0 and matched:  # a cached continuation that differs from its first token
                    who, sib = self._any_child(pool, parent, sig)
                if sib >= 0:
                    diverged_at = start + best
                    found = ("diverged", who, "")
                    if self.decode is not None:
                        excerpt = self._excerpt(pool, tokens, n_prompt, diverged_at, best, sib)
            if found is None:
                found = ("diverged", brk[1], "") if brk is not None and brk[0] == "diverged" else ("cold", "", "")
            if brk is None:
                brk = found
            add(start, bs, *found)
            k += 1
            if not (stored_ok or reconf_ok or content_ok) and brk[0] != "collision":
                rest = ("diverged", brk[1], "") if brk[0] == "diverged" else ("cold", "", "")
                if k < limit:  # every later block: never stored, no cached twin (prefix-closed)
                    add(k * bs, (limit - k) * bs, *rest)
                break
        if n_prompt > limit * bs:
            add(limit * bs, n_prompt - limit * bs, "tail")
        return miss_object(spans, diverged_at, excerpt, evicted_at, policy, cleared_at, not across_keys)

    def _sibling(self, pool, block: list[int], key: tuple) -> tuple[int, str, int]:
        """(the longest common prefix with a cached block at this chain position under the same
        keys, starting with the same token, its creator, its id); (0, "", -1) when none."""
        best, who, bid = 0, "", -1
        for b in _members(self.kids, key, MAX_SIBLINGS):
            theirs = pool.token_ids(b)
            n = 0
            for x, y in zip(block, theirs):
                if x != y:
                    break
                n += 1
            if n > best:
                best, who, bid = n, pool.blocks[b].creator or "", b
        return best, who, bid

    def _any_child(self, pool, parent: int, sig) -> tuple[str, int]:
        """(creator, id) of the oldest cached child of `parent` under `sig`; ("", -1) if none."""
        kids = pool.children.get(parent)
        if kids is None:
            return "", -1
        cands = [b for b in (kids if isinstance(kids, set) else (kids,))
                 if b in self.live and self.live[b][1] == sig][:MAX_SIBLINGS]
        if not cands:
            return "", -1
        b = min(cands, key=lambda b: pool.blocks[b].created_seq)
        return pool.blocks[b].creator or "", b

    def _excerpt(self, pool, tokens: list[int], n_prompt: int, at: int, within: int, sibling: int):
        """~`EXCERPT_CHARS` decoded characters on each side of the divergence point, for the
        prompt and for the cached sibling."""
        try:
            left = self.decode(tokens[max(0, at - EXCERPT_TOKENS):at])[-EXCERPT_CHARS:]
            mine = self.decode(tokens[at:min(n_prompt, at + EXCERPT_TOKENS)])[:EXCERPT_CHARS]
            theirs = self.decode(list(pool.token_ids(sibling)[within:within + EXCERPT_TOKENS]))[:EXCERPT_CHARS]
        except Exception:  # a tokenizer that cannot decode these ids: no excerpt
            return None
        if not (left or mine or theirs):  # no tokenizer behind `decode` (the simulator's)
            return None
        return (left + mine, left + theirs)


def _only_salt_differs(a, b) -> bool:
    """Two sigs (cache generation, salt) that differ only in the salt."""
    return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2 and a[0] == b[0] and a[1] != b[1]
