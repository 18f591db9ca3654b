"""The cached prefixes as a radix tree: a view on a Mirror's blocks (wire/mirror.py `Mirror.blocks`).

A **node** is a run of blocks that the same set of cached sequences share: a chain of blocks,
each the only cached child of the one before, is one node; a node ends where its last block has
no cached child (the end of a sequence) or several (a branch). A shared system prompt is one
node with a branch per conversation. A block whose parent is not cached (the mirror joined late,
or a middle block was evicted) starts a root of its own (`orphan`).

Each node knows its blocks (mirror keys, in order), tokens, creator (of its first block; the
`creators` of a mixed run too), `holders` (every session that stored or reused one of its
blocks: the creator first), hits and age. Children are sorted by the blocks below them, largest
first; `shown(node, limit)` is what a view lists (the first `limit` children, the rest counted,
"+ 4,213 more branches", until asked for).

`PrefixTree(blocks)` builds in O(blocks) with no recursion (chains can be thousands of blocks
deep); `node_of(key)` finds a block's node by walking up to its node's first block; `match(tokens)`
is how many leading tokens of a prompt are cached (prefix match by block tokens, the way a server
looks them up), the prediction `predicted_hit` makes for a request. `Labels` turns a node's tokens
into text through a `detokenize(token_ids) -> str` callable (the local tokenizer, or a server's
/detokenize), decoding at most `LABEL_TOKENS` tokens per node and caching at most `LABEL_CACHE`
labels; a branch's label starts where it differs from its siblings ("… and why does it").

`to_text` is a human view: its labels and names are inert (kvplay/inert.py); `to_json` keeps them
as they are (JSON escapes them). Given the miss attribution's marks (wire/miss_watch.py), nodes
say where prompts branch (`⑂ prompts branch at token 497`, and on the branch: `⑂ diverged at 497
from alice`) and which chains were evicted and then recomputed (`↻ recomputed 4 blk, evicted 12s
ago by carol`).

Pure: no Textual, no SQLite, no network.
"""
from __future__ import annotations

import gc
import time
from collections import Counter, OrderedDict
from typing import Callable, Iterable

from kvplay.inert import inert

SHOWN_CHILDREN = 8      # children a view lists before "+ N more branches"
LABEL_TOKENS = 48       # tokens decoded for a node's label (the rest is "…")
LABEL_CACHE = 4096      # labels kept
MAX_DEPTH = 64          # levels rendered as text/JSON (deeper ones are counted)
EXTRA_ITEMS = 64        # values in one block's extra keys kept for matching (more: unmatchable)
EXTRA_DEPTH = 4         # ... and levels of nesting


class Node:
    __slots__ = ("id", "keys", "tokens", "creator", "creators", "holders", "hits", "first_ts", "last_ts",
                 "children", "parent", "blocks_below", "sequences", "orphan", "marks", "branch_at")

    def __init__(self, nid: int, parent: "Node | None", orphan: bool):
        self.id = nid
        self.keys: list = []
        self.tokens = 0
        self.creator = None
        self.creators: Counter = Counter()
        self.holders: tuple = ()
        self.hits = 0
        self.first_ts = self.last_ts = 0.0
        self.children: list[Node] = []
        self.parent = parent
        self.blocks_below = 0   # blocks in this node and every node under it
        self.sequences = 0      # cached sequences (leaves) through this node
        self.orphan = orphan
        self.marks: list = []   # the attribution's marks of its blocks (wire/miss_watch.py), in order
        self.branch_at = None   # a child diverged here: the first token where (the smallest)

    @property
    def reusers(self) -> tuple:
        """Sessions other than the creator that hold (reused) one of its blocks."""
        return tuple(h for h in self.holders if h != self.creator)

    def __repr__(self) -> str:
        return f"Node({self.id}, blocks={len(self.keys)}, creator={self.creator!r}, children={len(self.children)})"


_NO_CHILD = object()


def _columns(blocks) -> tuple:
    """(key -> slot, slot -> parent hash, slot -> tokens, slot -> creator, slot -> holders,
    slot -> time stored) of a Mirror's `blocks` view (its `columns`), or of a dict of its `Block`s."""
    columns = getattr(blocks, "columns", None)
    if columns is not None:
        return columns()
    slot_of = {k: i for i, k in enumerate(blocks)}
    rows = list(blocks.values())
    return (slot_of, {i: b.parent for i, b in enumerate(rows)}, {i: b.tokens for i, b in enumerate(rows)},
            [b.creator for b in rows], {i: b.holders for i, b in enumerate(rows)}, [b.ts for b in rows])


def _parent_key(key, parent):
    """A block's parent's mirror key: hybrid models' groups other than 0 key by (group, hash)."""
    if parent is None:
        return None
    return (key[0], parent) if type(key) is tuple else parent


class PrefixTree:
    """The radix tree of the cached blocks `blocks` (a Mirror's `blocks`: key -> block with
    `.parent .tokens .size .creator .holders .ts`). `hits` maps a key to its hits when the source
    counts them; else a block's hits are its holders beyond the creator. `marks` maps a key to
    what the miss attribution says of the chain it starts (wire/miss_watch.py `PodMisses.marks`:
    a branch, the same tokens under other keys, recomputed after an eviction): each node lists
    its blocks' (`marks`), and a node a child diverged from says at which token (`branch_at`)."""

    def __init__(self, blocks: dict, hits: dict | None = None, version: int = 0, marks: dict | None = None):
        t0 = time.perf_counter()
        was = gc.isenabled()
        gc.disable()  # builds a million small objects: the collector would walk the heap many times
        try:
            self._build(blocks, hits, version)
            if marks:
                self._mark(marks)
        finally:
            if was:
                gc.enable()
        self.build_s = time.perf_counter() - t0

    def _mark(self, marks: dict) -> None:
        """Each mark on the node that holds its block; a diverged chain that starts a branch marks
        its parent node with where the prompts differ."""
        for key, mark in marks.items():
            node = self.node_of(key)
            if node is None:
                continue
            node.marks.append(mark)
            if mark.get("kind") == "diverged" and node.keys[0] == key and node.parent is not None:
                at = mark.get("at")
                p = node.parent
                if at is not None and (p.branch_at is None or at < p.branch_at):
                    p.branch_at = at

    def _build(self, blocks: dict, hits: dict | None, version: int) -> None:
        """The hot loop of a million-block tree reads the blocks' columns (`_columns`): no
        object per block."""
        self.blocks = blocks
        slot_of, parent_of, tokens_of, creator_of, holders_of, ts_of = _columns(blocks)
        self.version = version
        self.roots: list[Node] = []
        self.nodes: list[Node] = []
        self._start: dict = {}   # a node's first block key -> node
        self._index: PrefixMatcher | None = None  # built for match()
        children: dict = {}
        roots = []
        for key, s in slot_of.items():
            pk = _parent_key(key, parent_of.get(s))
            if pk is None or pk not in slot_of:
                roots.append((key, pk is not None))
            else:  # one child: the key itself; a list only where a branch starts (no million lists)
                kids = children.get(pk, _NO_CHILD)
                if kids is _NO_CHILD:
                    children[pk] = key
                elif type(kids) is list:
                    kids.append(key)
                else:
                    children[pk] = [kids, key]
        stack = [(key, None, orphan) for key, orphan in reversed(roots)]
        while stack:
            key, parent, orphan = stack.pop()
            node = Node(len(self.nodes), parent, orphan)
            self.nodes.append(node)
            self._start[key] = node
            (self.roots if parent is None else parent.children).append(node)
            holders: dict = {}
            while True:
                s = slot_of[key]
                node.keys.append(key)
                node.tokens += len(tokens_of.get(s, ()))
                creator = creator_of[s]
                node.creators[creator] += 1
                holders.setdefault(creator, None)
                held = holders_of.get(s, ())
                for h in held:
                    holders.setdefault(h, None)
                node.hits += hits.get(key, 0) if hits is not None else len(held) - 1
                ts = ts_of[s]
                if len(node.keys) == 1:
                    node.first_ts = node.last_ts = ts
                else:
                    node.first_ts = min(node.first_ts, ts)
                    node.last_ts = max(node.last_ts, ts)
                kids = children.get(key, _NO_CHILD)
                if kids is _NO_CHILD or type(kids) is list:
                    break
                key = kids
            node.creator = creator_of[slot_of[node.keys[0]]]
            node.holders = tuple(holders)
            if type(kids) is list:
                for k in reversed(kids):
                    stack.append((k, node, False))
        for node in reversed(self.nodes):  # children come after their parent: sizes bottom-up
            node.blocks_below += len(node.keys)
            node.sequences = node.sequences or 1
            node.children.sort(key=lambda n: (-n.blocks_below, n.first_ts, n.id))
            p = node.parent
            if p is not None:
                p.blocks_below += node.blocks_below
                p.sequences += node.sequences
        self.roots.sort(key=lambda n: (-n.blocks_below, n.first_ts, n.id))

    # --- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def node_of(self, key) -> Node | None:
        """The node holding block `key` (None when it is not cached): up to its node's first block."""
        b = self.blocks.get(key)
        while b is not None:
            node = self._start.get(key)
            if node is not None:
                return node
            key = _parent_key(key, b.parent)
            b = self.blocks.get(key)
        return None

    def path(self, node: Node) -> list[Node]:
        """The nodes from a root down to `node`."""
        out = []
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def prefix_tokens(self, node: Node) -> int:
        """Tokens from the root to the end of `node`."""
        return sum(n.tokens for n in self.path(node))

    # --- prediction -------------------------------------------------------------------------------
    def match(self, token_ids) -> int:
        """How many leading tokens of `token_ids` the cached blocks hold (see PrefixMatcher)."""
        return self._matcher().match(token_ids)

    def predicted_hit(self, token_ids) -> int | None:
        return self._matcher().predicted_hit(token_ids)

    def _matcher(self) -> "PrefixMatcher":
        if self._index is None:
            self._index = PrefixMatcher(self.blocks)
        return self._index

    # --- what a view lists ------------------------------------------------------------------------
    @staticmethod
    def shown(children: list[Node], limit: int = SHOWN_CHILDREN) -> tuple[list[Node], int, int]:
        """The first `limit` of `children`, and how many branches (and blocks) are left out."""
        if len(children) <= limit:
            return children, 0, 0
        rest = children[limit:]
        return children[:limit], len(rest), sum(n.blocks_below for n in rest)


class PrefixMatcher:
    """A prompt's cached prefix, found the way a server finds it: block by block from a true root
    (a block with no parent), each block matched by its tokens under the one before — and by its
    **extra keys** (a cache salt, a LoRA, as the server's events list them per block; None when
    none), which the server hashes too. O(blocks) to build from a mirror's blocks, or kept up to
    date block by block (`add`, `remove`, `clear`: what attach does as batches arrive); O(prompt)
    to ask.

    `salts` says which extra keys the asker's requests get (learned from the events of its own
    session; None: not known yet). Where only blocks with other extra keys match, a known salt
    stops the match (another user's salted blocks are no hit), and an unknown one makes the
    prediction None: it cannot be known before the server says which salt it applies."""

    def __init__(self, blocks: dict | None = None):
        self.index: dict = {}   # (parent key, tokens) -> key, blocks without extra keys
        self.salted: dict = {}  # (parent key, tokens) -> {extra keys: key}, blocks with some
        self._entry: dict = {}  # key -> its index entry
        self._extra: dict = {}  # key -> its extra keys (salted blocks only)
        self.sizes: list[int] = []
        if blocks:
            was = gc.isenabled()
            gc.disable()  # a million index entries: see PrefixTree
            try:
                slot_of, parent_of, tokens_of = _columns(blocks)[:3]
                for key, s in slot_of.items():
                    self.add(key, _parent_key(key, parent_of.get(s)), tokens_of.get(s, ()))
            finally:
                if was:
                    gc.enable()

    def add(self, key, parent_key, tokens, extra=None) -> None:
        """Block `key` under `parent_key` with `tokens` and (hashable) `extra` keys; a block seen
        before keeps its first entry (as the mirror keeps its first announcement)."""
        if not tokens or key in self._entry:
            return
        entry = (parent_key, tuple(tokens))
        if extra is None:
            self.index[entry] = key
        else:
            self.salted.setdefault(entry, {})[extra] = key
            self._extra[key] = extra
        self._entry[key] = entry
        if len(tokens) not in self.sizes:
            self.sizes = sorted(self.sizes + [len(tokens)])

    def remove(self, key) -> None:
        entry = self._entry.pop(key, None)
        if entry is None:
            return
        extra = self._extra.pop(key, None)
        if extra is None:
            if self.index.get(entry) == key:
                del self.index[entry]
            return
        cands = self.salted.get(entry)
        if cands is not None and cands.get(extra) == key:
            del cands[extra]
            if not cands:
                del self.salted[entry]

    def clear(self) -> None:
        self.index.clear()
        self.salted.clear()
        self._entry.clear()
        self._extra.clear()

    def __len__(self) -> int:
        return len(self._entry)

    def _walk(self, token_ids, salts=None, keys: list | None = None) -> tuple[int, int, bool]:
        """(tokens matched, size of the last matched block, whether the match stopped where only
        the salt decides: blocks with these tokens under other extra keys, salt unknown); the
        matched blocks' keys are appended to `keys` when given."""
        toks = list(token_ids)
        pos, parent, last = 0, None, 0
        index, salted = self.index, self.salted
        while True:
            unsure = False
            for size in self.sizes:
                if pos + size <= len(toks):
                    entry = (parent, tuple(toks[pos:pos + size]))
                    key = None
                    if salted:
                        cands = salted.get(entry)
                        if cands and salts:
                            key = next((cands[x] for x in salts if x in cands), None)
                        elif cands and salts is None and entry not in index:
                            unsure = True
                            continue
                    if key is None:
                        key = index.get(entry)
                    if key is None:
                        continue
                    pos, parent, last = pos + size, key, size
                    if keys is not None:
                        keys.append(key)
                    break
            else:
                return pos, last, unsure

    def match(self, token_ids, salts=None) -> int:
        return self._walk(token_ids, salts)[0]

    def chain(self, token_ids, salts=None) -> list:
        """The keys of the cached blocks a prompt's prefix matches, in order."""
        keys: list = []
        self._walk(token_ids, salts, keys)
        return keys

    def predicted_hit(self, token_ids, salts=None) -> int | None:
        """The cached tokens a server should report for this prompt: the matched blocks, less the
        block holding the last prompt token when it matched (that token is always computed).
        None when the salt decides and is not known (see the class)."""
        matched, last, unsure = self._walk(token_ids, salts)
        if unsure:
            return None
        return matched - last if matched and matched >= len(token_ids) else matched


def frozen_extra(value, depth: int = 0, budget: list | None = None):
    """One block's extra keys as the events sent them (lists, maps, strings, bytes, numbers,
    hostile or not) as a hashable value: lists become tuples, maps tuples of pairs; more than
    `EXTRA_ITEMS` items or `EXTRA_DEPTH` levels in all is "?" (such a block never matches a salt)."""
    budget = [EXTRA_ITEMS] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or depth > EXTRA_DEPTH:
        return "?"
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        out = tuple(frozen_extra(v, depth + 1, budget) for v in value)
    elif isinstance(value, dict):
        out = tuple((frozen_extra(k, depth + 1, budget), frozen_extra(v, depth + 1, budget)) for k, v in value.items())
    else:
        return "?"
    return "?" if budget[0] < 0 else out


class Labels:
    """Node labels as text through `detokenize(token_ids) -> str`, at most `LABEL_TOKENS` tokens
    decoded per node and `size` labels cached (by the node's first block and length)."""

    def __init__(self, detokenize: Callable[[list[int]], str] | None, size: int = LABEL_CACHE):
        self.detokenize = detokenize
        self.size = size
        self._cache: OrderedDict = OrderedDict()

    @staticmethod
    def _shared(tree: PrefixTree, node: Node, siblings: int = 64) -> int:
        """Tokens a branch's first block shares with its siblings' (the prompts diverge inside a
        block): its label starts where it differs, after "…"."""
        if node.parent is None:
            return 0
        first = tree.blocks[node.keys[0]].tokens
        best = 0
        for sib in node.parent.children[:siblings]:
            if sib is node:
                continue
            other = tree.blocks[sib.keys[0]].tokens
            n = 0
            for a, b in zip(first, other):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, max(0, len(first) - 1))

    def __call__(self, tree: PrefixTree, node: Node) -> str:
        skip = self._shared(tree, node)
        key = (node.keys[0], len(node.keys), skip)
        text = self._cache.get(key)
        if text is not None:
            self._cache.move_to_end(key)
            return text
        ids: list[int] = []
        for k in node.keys:
            ids.extend(tree.blocks[k].tokens)
            if len(ids) >= LABEL_TOKENS + skip:
                break
        more = len(ids) > LABEL_TOKENS + skip or node.tokens > len(ids)
        ids = ids[skip:skip + LABEL_TOKENS]
        text = ""
        if self.detokenize is not None and ids:
            try:
                text = self.detokenize(ids) or ""
            except Exception:  # a tokenizer or a server failing is a missing label, not a crash
                text = ""
        decoded = bool(text)
        if not text and ids:  # no text (yet: a server's /detokenize may answer later): ids, not cached
            text = " ".join(map(str, ids))
        text = " ".join(text.replace("\n", " ⏎ ").split())
        if skip:
            text = "… " + text
        if more:
            text += " …"
        if not decoded:
            return text
        self._cache[key] = text
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return text


def age_text(seconds: float) -> str:
    if seconds < 60:
        return f"{max(0, seconds):.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def node_dict(tree: PrefixTree, node: Node, label: str, now: float) -> dict:
    return {"id": node.id, "text": label, "blocks": len(node.keys), "tokens": node.tokens,
            "prefix_tokens": tree.prefix_tokens(node), "creator": node.creator,
            "creators": dict(node.creators) if len(node.creators) > 1 else None,
            "reused_by": list(node.reusers), "hits": node.hits,
            "age_s": round(max(0.0, now - node.last_ts), 3) if node.last_ts else None,
            "sequences": node.sequences, "blocks_below": node.blocks_below, "orphan": node.orphan,
            "branch_at": node.branch_at, "marks": list(node.marks)}


def mark_text(mark: dict, now: float) -> str:
    """One attribution mark as words: `diverged at 497 from alice`, `isolated from bob (4 blk)`,
    `recomputed 4 blk, evicted 12s ago by carol`; names inert."""
    kind = mark.get("kind")
    who = inert(str(mark.get("from") or "?"), limit=64)
    if kind == "diverged":
        at = mark.get("at")
        return f"diverged{'' if at is None else f' at {at}'} from {who}"
    if kind in ("isolated", "config"):
        return f"{kind} from {who} ({mark.get('blocks')} blk)"
    if kind == "recomputed":
        when = mark.get("removed_at")
        text = f"recomputed {mark.get('blocks')} blk, {mark.get('reason')}"
        if isinstance(when, (int, float)):
            text += f" {age_text(now - when)} ago"
        if mark.get("evicted_by"):
            text += f" by {inert(str(mark['evicted_by']), limit=64)}"
        return text
    return inert(str(kind), limit=32)


def to_json(tree: PrefixTree, labels: Labels, limit: int = SHOWN_CHILDREN, now: float | None = None,
            max_depth: int = MAX_DEPTH) -> dict:
    """The tree as nested dicts: `{"blocks", "nodes", "roots": [node...]}`, each node with its
    `children` (the first `limit`) and `more` (`{"branches", "blocks"}` left out) when any."""
    now = time.time() if now is None else now
    out = {"blocks": tree.num_blocks, "nodes": len(tree), "roots": []}
    stack = [(out["roots"], tree.roots, 0)]
    while stack:
        dest, kids, depth = stack.pop()
        shown, more, more_blocks = tree.shown(kids, limit)
        if depth >= max_depth and kids:
            shown, more, more_blocks = [], len(kids), sum(n.blocks_below for n in kids)
        for n in shown:
            d = node_dict(tree, n, labels(tree, n), now)
            d["children"] = []
            dest.append(d)
            stack.append((d["children"], n.children, depth + 1))
        if more:
            dest.append({"more": {"branches": more, "blocks": more_blocks}})
    return out


def to_text(tree: PrefixTree, labels: Labels, limit: int = SHOWN_CHILDREN, now: float | None = None,
            width: int = 100, max_depth: int = MAX_DEPTH) -> list[str]:
    """The tree as indented lines, depth first with no recursion:
    `├─ "text" · 4 blk 64 tok · alice → bob, carol · 3 hits · 12s`."""
    now = time.time() if now is None else now
    out = [f"{tree.num_blocks:,} cached blocks in {len(tree):,} nodes"]
    stack: list = []

    def push(prefix: str, kids: list, depth: int) -> None:
        shown, more, more_blocks = tree.shown(kids, limit)
        if depth >= max_depth and kids:
            shown, more, more_blocks = [], len(kids), sum(n.blocks_below for n in kids)
        items = [(prefix, n, i == len(shown) - 1 and not more, depth) for i, n in enumerate(shown)]
        if more:
            items.append((prefix, None, (more, more_blocks), depth))
        stack.extend(reversed(items))

    push("", tree.roots, 0)
    while stack:
        p, n, last, d = stack.pop()
        if n is None:
            out.append(p + f"└─ + {last[0]:,} more branches ({last[1]:,} blocks)")
            continue
        head = p + ("└─ " if last else "├─ ")
        out.append(head + node_line(tree, n, labels, now, max(10, width - len(head))))
        if n.children:
            push(p + ("   " if last else "│  "), n.children, d + 1)
    return out


def node_line(tree: PrefixTree, node: Node, labels: Labels, now: float, width: int = 100) -> str:
    """One node as a line of text; its label and the session ids inert."""
    facts = f" · {len(node.keys)} blk {node.tokens} tok · {inert(node.creator or '?', limit=64)}"
    if node.reusers:
        facts += " → " + ", ".join(inert(r, limit=64) for r in node.reusers[:16])
        if len(node.reusers) > 16:
            facts += f", + {len(node.reusers) - 16:,} more"
    if node.hits:
        facts += f" · {node.hits} hits"
    if node.last_ts:
        facts += f" · {age_text(now - node.last_ts)}"
    if node.orphan:
        facts += " · parent not cached"
    if node.branch_at is not None:
        facts += f" · ⑂ prompts branch at token {node.branch_at}"
    for mark in node.marks[:4]:
        facts += " · " + ("↻ " if mark.get("kind") == "recomputed" else "⑂ ") + mark_text(mark, now)
    if len(node.marks) > 4:
        facts += f" · + {len(node.marks) - 4} more marks"
    room = max(8, width - len(facts) - 2)
    text = inert(labels(tree, node), limit=room)
    if len(text) > room:
        text = text[:room - 1] + "…"
    return f"\"{text}\"{facts}"


def blocks_of(nodes: Iterable[Node]) -> list:
    return [k for n in nodes for k in n.keys]
