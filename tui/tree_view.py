"""The prefix tree view (ctrl+r in the playground and in attach, `t` in the scrubber): the cached
prefixes as a radix tree (wire/tree.py), each node its decoded text, blocks and tokens, its
creator's glyph and colour → the users who reused it, hits and age; beside it the block map with
the selected node's blocks marked (`+`) and zoomed to.

Keys: ↑/↓ move, → or enter opens a node (its first `SHOWN_CHILDREN` branches; the
"+ N more branches" line opens the next ones), ← closes; `m` moves to the map, where a click or
the arrows pick a block and `f` finds its node; escape closes. The tree is rebuilt when the cache
changes, at most every `REFRESH_S` (longer when building takes long: a big pool); the nodes that
were open stay open.

What changed since the last build animates (tui/tree_anim.py): a node that got stored fades in
from its creator's colour ("new"), a reused one pulses in its reuser's, an evicted one stays a
moment struck through and fading, then goes; their blocks flash on the map. At most
`MAX_CHANGES` nodes animate at once, one frame every `FRAME_S` while any does (no timer runs
otherwise): bounded work per frame at any pool size. The clock is `screen.clock` and a frame is
`screen.animate()` (tests drive both). A tree at a fixed point of a recording (`at`, the
scrubber) does not animate: it marks what changed at that step (the source's `before`), still.

The trees are built on a worker thread from copies of the mirrors (`Mirror.copy`) (a 1M-block pool
takes seconds to build: the screen stays live meanwhile and shows the last tree).

A *tree source* gives the mirrors and maps their blocks to map cells:
`version`, `snapshot() -> [(pod, blocks, hits or None, version, marks or None)]` (copies; marks: the
miss attribution's, wire/miss_watch.py), `block_ids(pod, keys) -> [block id]`,
`key_of(block_id) -> (pod, key) | None`, `detokenize` (a callable or None), `map_source` (what
the block map reads; None: the caller sets the map's blocks) and `before` (a snapshot of the step
before, or None). `MirrorTrees` is the local engine's and a recording's Mirror, `FleetTrees` an
attached server's mirrors (wire/mirror.py both).

A node's text and the session ids are inert (kvplay/inert.py): a server's /detokenize answers and
session ids are shown, never obeyed.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from rich.style import Style
from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Static, Tree

from kvplay.inert import inert
from kvplay.wire.tree import SHOWN_CHILDREN, Labels, PrefixTree, age_text, mark_text

from .blockmap import BlockMap
from .theme import UNKNOWN_COLOUR
from .tree_anim import DURATION, MARK, MAX_CHANGES, anim_style, diff_trees, still_style

REFRESH_S = 0.5
LABEL_W = 40  # characters of a node's text in its line
FRAME_S = 0.1  # an animation frame
FLASH_IDS = 512  # blocks of one animated node flashed on the map


# --- sources ------------------------------------------------------------------------------------
class MirrorTrees:
    """Trees of one Mirror (wire/mirror.py: the local engine's, or a recording's at the
    scrubber's cursor); its slots are the map's block ids. `lock`: what the mirror's writer holds."""

    def __init__(self, mirror, detokenize=None, map_source=None, lock=None, before=None, marks=None):
        self.mirror = mirror
        self.detokenize = detokenize
        self.map_source = map_source
        self.lock = lock if lock is not None else threading.Lock()
        self.before = before  # snapshot() of the step before (the scrubber's): what changed at this one
        self.marks = marks  # () -> {key: mark} of the miss attribution (wire/miss_watch.py), or None

    @property
    def version(self) -> int:
        return self.mirror.version

    def snapshot(self) -> list:
        """(pod, blocks, hits, version, marks) of a copy of the mirror, taken under its writer's lock."""
        with self.lock:
            m = self.mirror.copy()
            marks = self.marks() if self.marks is not None else None
        hits = m.block_hits()
        return [(pod, blocks, hits, m.version, marks) for pod, blocks in m.pods_blocks().items()]

    def block_ids(self, pod, keys) -> list[int]:
        return [s for s in map(self.mirror.key_slot.get, keys) if s is not None]

    def key_of(self, block_id: int):
        key = self.mirror.key.get(block_id)
        return None if key is None else (self.mirror.pod_of(key), key)


class FleetTrees:
    """Trees of an attached server's mirrors (RemoteBackend.fleet); block ids are its map's slots;
    text from the server's /detokenize, fetched off the UI thread (`RemoteLabels`)."""

    before = None

    def __init__(self, backend):
        self.backend = backend
        self.detokenize = RemoteText(backend.decode)
        self.map_source = backend

    @property
    def version(self) -> int:
        return self.backend.version

    def snapshot(self) -> list:
        """Hits None: counted from the blocks' holders when the tree is built (off this thread)."""
        b = self.backend
        with b.fleet.lock:  # the subscriber thread applies batches under it
            copies = [(name, m.copy(), b.misses.pod(name).marks()) for name, m in b.fleet.pods.items()]
        return [(name, m.blocks, None, m.version, marks) for name, m, marks in copies]

    def block_ids(self, pod, keys) -> list[int]:
        m = self.backend.pods.get(pod)
        if m is None:
            return []
        return [s + m.offset for s in map(m.key_slot.get, keys) if s is not None]

    def key_of(self, block_id: int):
        for name, m in self.backend.pods.items():
            s = block_id - m.offset
            if 0 <= s < m.num_blocks:
                key = m.key.get(s)
                return None if key is None else (name, key)
        return None


class RemoteText:
    """`detokenize` that never blocks the UI: an unknown id run answers "" (the label shows ids)
    and is fetched on one worker thread; `version` moves when a text arrives. Bounded: at most
    `size` texts kept and `pending` fetches queued."""

    def __init__(self, fetch, size: int = 4096, pending: int = 256):
        self.fetch = fetch
        self.size, self.max_pending = size, pending
        self.done: OrderedDict = OrderedDict()
        self.pending: set = set()
        self.version = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvplay-detokenize")

    def __call__(self, ids) -> str:
        key = tuple(ids)
        with self._lock:
            text = self.done.get(key)
            if text is not None:
                return text
            if key in self.pending or len(self.pending) >= self.max_pending:
                return ""
            self.pending.add(key)
        self._pool.submit(self._get, key)
        return ""

    def _get(self, key) -> None:
        try:
            text = self.fetch(list(key)) or ""
        except Exception:
            text = ""
        with self._lock:
            self.pending.discard(key)
            if text:
                self.done[key] = text
                if len(self.done) > self.size:
                    self.done.popitem(last=False)
                self.version += 1


# --- the screen ---------------------------------------------------------------------------------
def node_label(tree: PrefixTree, node, labels: Labels, looks: dict, now: float, mark=None) -> Text:
    """`A 32 blk 512 tok → B C · 32 hits · 12s "You are Harbor…"`: the creator's glyph, then who
    reused it, in the users' colours; the text last, so a narrow terminal cuts only the text.
    `mark` = (kind, phase — None when still —, who, blocks, ghost) puts what just happened first:
    `new`, `reused by B`, `−3 blk evicted` in its style (tree_anim.anim_style); a ghost (a node
    evicted whole) is struck through."""
    t = Text()
    look = looks.get(node.creator)
    ghost = False
    if mark is not None:
        kind, phase, who, blocks, ghost = mark
        lk = looks.get(who)
        colour = lk.colour if lk else UNKNOWN_COLOUR
        style = still_style(kind, colour) if phase is None else anim_style(kind, phase, colour)
        word = MARK[kind] if phase is not None else f"{MARK[kind]} here"
        if kind == "reused" and lk is not None:
            word += f" by {lk.glyph}"
        elif kind == "evicted" and not ghost:
            word = f"−{blocks} blk {word}"
        t.append(f" {word} ", style=style)
        t.append(" ")
    start = len(t)
    t.append(f"{look.glyph if look else '?'} ", style=look.style if look else UNKNOWN_COLOUR)
    t.append(f"{len(node.keys)} blk {node.tokens} tok", style="dim")
    if node.reusers:
        t.append(" →")
        for who in node.reusers:
            lk = looks.get(who)
            t.append(f" {lk.glyph if lk else inert(who, limit=64)}", style=lk.style if lk else UNKNOWN_COLOUR)
    if node.hits:
        t.append(f" · {node.hits} hits", style="dim")
    if node.last_ts:
        t.append(f" · {age_text(now - node.last_ts)}", style="dim")
    if node.orphan:
        t.append(" · parent not cached", style="dim italic")
    if node.branch_at is not None:
        t.append(f" · ⑂ branch at {node.branch_at}", style="bold yellow")
    for m in node.marks[:2]:
        if m.get("kind") == "recomputed":
            t.append(f" · ↻ {m.get('reason')}", style="bold red")
        elif m.get("kind") == "diverged":
            t.append(" · ⑂ diverged" + (f" at {m['at']}" if m.get("at") is not None else ""), style="yellow")
        else:
            t.append(f" · ≠ {m.get('kind')}", style="magenta")
    text = inert(labels(tree, node), limit=LABEL_W)
    if len(text) > LABEL_W:
        text = text[:LABEL_W - 1] + "…"
    t.append(f" \"{text}\"", style=look.colour if look else UNKNOWN_COLOUR)
    if ghost:
        t.stylize(Style(strike=True, dim=True), start)
    return t


class TreeScreen(Screen):
    """The prefix tree next to the block map (see the module's docstring)."""

    DEFAULT_CSS = """
    TreeScreen { layout: vertical; }
    #tree-main { height: 1fr; }
    #prefix-tree { width: 1fr; min-width: 40; overflow-x: hidden; }
    #tree-side { width: 40%; max-width: 56; min-width: 28; border-left: vkey $panel-lighten-2; padding: 0 1; }
    #tree-map { height: auto; max-height: 18; min-height: 2; background: transparent; }
    #tree-detail { height: auto; color: $text-muted; border-top: dashed $panel-lighten-2; }
    #tree-head { height: 1; padding: 0 1; color: $text-muted; }
    """

    BINDINGS = [
        Binding("escape", "close", "Close", id="tree.close"),
        Binding("right", "open_node", "Open", show=False, id="tree.open"),
        Binding("left", "close_node", "Close node", show=False, id="tree.close_node"),
        Binding("f", "find_block", "Find map block", id="tree.find"),
        Binding("m", "focus_map", "Map", id="tree.map"),
    ]

    def __init__(self, source, looks: dict, title: str = "Prefix tree", at: float | None = None) -> None:
        super().__init__()
        self.at = at  # the time ages are counted to (a recording's cursor); None: now
        self.source = source
        self.looks = looks
        self.heading = title
        self.labels = Labels(source.detokenize)
        self.trees: dict = {}
        self._built_version = None
        self._built_at = 0.0
        self._interval = REFRESH_S
        self._building = False
        self._texts_version = None
        self.ready = False  # the first trees are built and shown
        self._open: set = set()  # (pod, first key) of the nodes open
        self._reveal: set = set()  # ... of nodes found from the map: listed even past SHOWN_CHILDREN
        self.still = at is not None  # a fixed point of a recording: marks what changed there, no frames
        self.clock = time.monotonic  # the animations' clock (tests set their own)
        self.anims: dict = {}  # ("n"|"g", pod, first key) -> [Change, start time, pod, tree, block ids]
        self.changes_left_out = 0  # changes past MAX_CHANGES at the last build
        self.builds = 0  # trees built and shown
        self._hits: dict = {}  # pod -> {key: hits} of the trees shown (what a reuse is told from)
        self._tn: dict = {}  # anims' keys -> the Textual tree node showing them now
        self._flash_keys: frozenset = frozenset()  # the anims whose blocks flash on the map now
        self._frames = None  # the frame timer, paused while nothing animates

    def compose(self):
        yield Static(id="tree-head")
        with Horizontal(id="tree-main"):
            yield Tree("cache", id="prefix-tree")
            with Vertical(id="tree-side"):
                yield BlockMap(id="tree-map")
                yield Static(Text("a node's blocks are marked + on the map; "
                                  "pick a block there (m, arrows or a click), f finds its node", style="dim"), id="tree-detail")
        yield Footer()

    def on_mount(self) -> None:
        t = self.query_one(Tree)
        t.show_root = False
        t.guide_depth = 2
        self.query_one(BlockMap).own_marks = True  # the app's redraws leave its marks alone
        if self.source.map_source is not None:
            self.query_one(BlockMap).set_source(self.source.map_source, self.looks)
        self.rebuild()
        self.set_interval(REFRESH_S, self._tick)
        self._frames = self.set_interval(FRAME_S, self.animate, pause=True)
        t.focus()

    def now(self) -> float:
        return time.time() if self.at is None else self.at

    def _tick(self) -> None:
        if self.source.version != self._built_version and time.monotonic() - self._built_at >= self._interval:
            self.rebuild()
        texts = getattr(self.labels.detokenize, "version", None)  # a server's texts arriving
        if texts != self._texts_version and self.ready:
            self._texts_version = texts
            self.populate()

    # --- building ---------------------------------------------------------------------------------
    def rebuild(self) -> None:
        """New trees from the source, built aside; then `populate` shows them."""
        if self._building:
            return
        self._building = True
        self._built_version = self.source.version
        before = getattr(self.source, "before", None) if self.still and not self.builds else None
        self._build(self.source.snapshot(), before, dict(self.trees), dict(self._hits))

    @work(thread=True, exit_on_error=False, group="tree-build", description="Building the prefix tree")
    def _build(self, snapshot: list, before: list | None, old: dict, old_hits: dict) -> None:
        """The trees, and what changed since `old` (or since `before`, the scrubber's step)."""
        t0 = time.monotonic()
        try:
            trees, hits = self._trees(snapshot)
            if before is not None:
                old, old_hits = self._trees(before)
            changes, more = [], 0
            for pod, tree in trees.items():
                got, left = diff_trees(old.get(pod), tree, old_hits.get(pod), hits[pod], MAX_CHANGES - len(changes))
                changes += [(pod, c) for c in got]
                more += left
        finally:
            self._building = False
        self.app.call_from_thread(self._built, trees, hits, changes, more, old, time.monotonic() - t0)

    @staticmethod
    def _trees(snapshot: list) -> tuple[dict, dict]:
        trees, hits = {}, {}
        for pod, blocks, h, version, *marks in snapshot:
            if h is None:  # an attached server's mirror: a block's hits are its holders beyond the creator
                h = {k: len(b.holders) - 1 for k, b in blocks.items() if len(b.holders) > 1}
            trees[pod], hits[pod] = PrefixTree(blocks, h, version, marks[0] if marks else None), h
        return trees, hits

    def _built(self, trees: dict, hits: dict, changes: list, more: int, old: dict, build_s: float) -> None:
        self.trees = trees
        self._hits = hits
        self.ready = True
        self.builds += 1
        self._built_at = time.monotonic()
        self._interval = max(REFRESH_S, 4 * build_s)  # a big pool: rebuild less often
        self._start_anims(changes, old)
        self.changes_left_out = more
        if self.is_attached:
            self.populate()

    # --- animation --------------------------------------------------------------------------------
    def _start_anims(self, changes: list, old: dict) -> None:
        """Marks for what changed; the oldest give way past MAX_CHANGES. Still: only this step's."""
        if self.still:
            self.anims.clear()
        now = self.clock()
        marked = set()
        for pod, c in changes:
            tree = old.get(pod) if c.ghost is not None else self.trees.get(pod)
            node = c.ghost if c.ghost is not None else (tree.node_of(c.key) if tree is not None else None)
            key = ("g" if c.ghost is not None else "n", pod, c.key)
            if node is None or key in marked:  # one mark a node: a store beats a partial eviction
                continue
            marked.add(key)
            ids = self.source.block_ids(pod, node.keys[:FLASH_IDS]) if c.kind != "evicted" else []
            self.anims.pop(key, None)
            self.anims[key] = [c, now, pod, tree, ids]
        while len(self.anims) > MAX_CHANGES:
            del self.anims[next(iter(self.anims))]
        if self._frames is not None and not self.still:
            if self.anims:
                self._frames.resume()
            else:
                self._frames.pause()

    def mark(self, key):
        """The `node_label` mark of animation `key` now, or None when it is over."""
        a = self.anims.get(key)
        if a is None:
            return None
        c, t0 = a[0], a[1]
        if self.still:
            return (c.kind, None, c.who, c.blocks, c.ghost is not None)
        phase = (self.clock() - t0) / DURATION[c.kind]
        if phase >= 1:
            return None
        return (c.kind, phase, c.who, c.blocks, c.ghost is not None)

    def animate(self) -> None:
        """One frame: every mark restyled at its phase; those done are dropped (a ghost's line
        goes), the map's flash follows. Work: the animations, at most MAX_CHANGES."""
        if self.still:
            return
        now = self.now()
        for key in list(self.anims):
            c, _t0, pod, tree, _ids = self.anims[key]
            m = self.mark(key)
            tn = self._tn.get(key)
            if m is None:
                del self.anims[key]
                self._tn.pop(key, None)
            if tn is None:
                continue
            if key[0] == "g":
                if m is None:
                    tn.remove()
                else:
                    tn.set_label(node_label(tree, c.ghost, self.labels, self.looks, now, m))
            else:
                node = tn.data[2]
                tn.set_label(node_label(self.trees[pod], node, self.labels, self.looks, now, m))
        self._update_flash()
        if not self.anims and self._frames is not None:
            self._frames.pause()

    def _update_flash(self) -> None:
        """The blocks of the nodes stored or reused in the first half of their animation flash
        on the map (recomputed only when that set of nodes changes)."""
        keys = frozenset(k for k, a in self.anims.items() if a[4] and (self.still or self.clock() - a[1] < DURATION[a[0].kind] / 2))
        if keys == self._flash_keys:
            return
        self._flash_keys = keys
        bm = self.query_one(BlockMap)
        bm.flash = bm.local([b for k in keys for b in self.anims[k][4]])
        bm._rebuild()

    def flashing(self) -> frozenset:
        bm = self.query_one(BlockMap)
        return bm.local([b for k in self._flash_keys if k in self.anims for b in self.anims[k][4]])

    def populate(self) -> None:
        """The Textual tree re-made from `trees`, with the same nodes open and the cursor kept."""
        widget = self.query_one(Tree)
        cursor = widget.cursor_node.data if widget.cursor_node is not None else None
        widget.clear()
        self._tn = {}
        now = self.now()
        blocks = sum(t.num_blocks for t in self.trees.values())
        nodes = sum(len(t) for t in self.trees.values())
        changed = ""
        if self.still and self.anims:
            kinds = [a[0].kind for a in self.anims.values()]
            changed = "this step: " + ", ".join(f"{kinds.count(k)} {MARK[k]}" for k in MARK if k in kinds) + " · "
        if self.changes_left_out:
            changed += f"+{self.changes_left_out:,} changes not marked · "
        self.query_one("#tree-head", Static).update(Text.assemble(
            (inert(self.heading, limit=256), "bold"), f" · {blocks:,} cached blocks in {nodes:,} nodes · ", changed,
            ("↑↓ move, → open, ← close, f find a map block, m map, esc close", "dim")))
        many = len(self.trees) > 1
        for pod, tree in self.trees.items():
            parent = widget.root
            if many:
                parent = widget.root.add(Text(f"pod {inert(pod, limit=256)}", style="bold"), data=("pod", pod), expand=True)
            self._add(parent, pod, tree, tree.roots, 0, now)
        if not nodes and not self._tn:
            widget.root.add_leaf(Text("no cached blocks yet", style="dim"))
        tn = self._restore_cursor(cursor) if cursor is not None else None
        if tn is None and widget.root.children:
            tn = widget.root.children[0]
            widget.move_cursor(tn)
        if tn is not None and tn.data and tn.data[0] == "node":
            self.show_node(tn.data[1], tn.data[2])
        self._update_flash()

    def _add(self, parent, pod, tree: PrefixTree, kids: list, start: int, now: float) -> None:
        """`kids`' lines from `start` under `parent` (and, on the first page, the ghosts of
        children evicted whole that are still fading)."""
        shown = kids[start:start + SHOWN_CHILDREN]
        rest = kids[start + SHOWN_CHILDREN:]
        if self._reveal and rest:  # a node found from the map is listed even beyond the first ones
            found = [n for n in rest if (pod, n.keys[0]) in self._reveal]
            if found:
                shown = shown + found
                rest = [n for n in rest if (pod, n.keys[0]) not in self._reveal]
        for n in shown:
            key = (pod, n.keys[0])
            akey = ("n", pod, n.keys[0])
            tn = parent.add(node_label(tree, n, self.labels, self.looks, now, self.mark(akey)), data=("node", pod, n),
                            allow_expand=bool(n.children))
            if akey in self.anims:
                self._tn[akey] = tn
            if key in self._open and n.children:
                self._add(tn, pod, tree, n.children, 0, now)
                tn.expand()
            elif not n.children and self._ghosts(tn, pod, n.keys[0], now):
                tn.expand()  # a leaf now (its evicted branch gone): the ghost shows under it
        if start == 0:
            self._ghosts(parent, pod, parent.data[2].keys[0] if parent.data and parent.data[0] == "node" else None, now)
        if rest:
            more = Text(f"+ {len(rest):,} more branches ({sum(n.blocks_below for n in rest):,} blocks): enter",
                        style="dim")
            parent.add_leaf(more, data=("more", pod, rest, 0))

    def _ghosts(self, parent, pod, above, now: float) -> int:
        """Lines under `parent` for the nodes evicted whole whose parent was `above` (a first key;
        None: the top), struck and fading."""
        n = 0
        for akey, (c, _t0, apod, atree, _ids) in list(self.anims.items()):
            if akey[0] == "g" and apod == pod and c.anchor == above:
                m = self.mark(akey)
                if m is not None:
                    self._tn[akey] = parent.add_leaf(node_label(atree, c.ghost, self.labels, self.looks, now, m),
                                                     data=("ghost", pod, c.ghost))
                    n += 1
        return n

    @on(Tree.NodeExpanded, "#prefix-tree")
    def _on_expand(self, msg: Tree.NodeExpanded) -> None:
        d = msg.node.data
        if not d or d[0] != "node":
            return
        _, pod, n = d
        if n.children:
            self._open.add((pod, n.keys[0]))
        if not msg.node.children:
            self._add(msg.node, pod, self.trees[pod], n.children, 0, self.now())

    @on(Tree.NodeCollapsed, "#prefix-tree")
    def _on_collapse(self, msg: Tree.NodeCollapsed) -> None:
        d = msg.node.data
        if d and d[0] == "node":
            self._open.discard((d[1], d[2].keys[0]))

    @on(Tree.NodeSelected, "#prefix-tree")
    def _on_select(self, msg: Tree.NodeSelected) -> None:
        d = msg.node.data
        if d and d[0] == "more":
            _, pod, kids, start = d
            parent = msg.node.parent
            msg.node.remove()
            self._add(parent, pod, self.trees[pod], kids, start, self.now())

    @on(Tree.NodeHighlighted, "#prefix-tree")
    def _on_highlight(self, msg: Tree.NodeHighlighted) -> None:
        d = msg.node.data
        if not d or d[0] != "node":
            return
        _, pod, n = d
        self.show_node(pod, n)

    def show_node(self, pod, n) -> None:
        """The node's blocks marked on the map (and zoomed to), its facts below it."""
        tree = self.trees.get(pod)
        if tree is None:
            return
        ids = self.source.block_ids(pod, n.keys)
        bm = self.query_one(BlockMap)
        bm.hit = bm.local(ids)
        bm.flash = self.flashing()
        bm._rebuild()
        if bm.hit:
            bm.show_blocks(bm.hit)
        t = Text()
        look = self.looks.get(n.creator)
        t.append("made by ", style="dim")
        t.append(inert(n.creator, limit=64), style=look.style if look else UNKNOWN_COLOUR)
        if len(n.creators) > 1:
            t.append(" (" + ", ".join(f"{inert(w, limit=64)} {c}" for w, c in n.creators.most_common(16)) + " blocks)",
                     style="dim")
        if n.reusers:
            t.append(" · reused by ", style="dim")
            for i, who in enumerate(n.reusers[:16]):
                lk = self.looks.get(who)
                t.append((", " if i else "") + inert(who, limit=64), style=lk.style if lk else UNKNOWN_COLOUR)
            if len(n.reusers) > 16:
                t.append(f", + {len(n.reusers) - 16:,} more", style="dim")
        t.append(f"\n{len(n.keys)} blocks, {n.tokens} tokens (prefix {tree.prefix_tokens(n)}), {n.hits} hits, "
                 f"{n.sequences} sequence{'s' if n.sequences != 1 else ''} through it", style="dim")
        if n.branch_at is not None:
            t.append(f"\n⑂ prompts branch here: the first differing token is {n.branch_at}", style="yellow")
        for m in n.marks[:8]:
            t.append("\n" + ("↻ " if m.get("kind") == "recomputed" else "⑂ ") + mark_text(m, time.time()),
                     style="red" if m.get("kind") == "recomputed" else "yellow")
        if not ids:
            t.append("\n(its blocks are not on this map)", style="dim italic")
        t.append("\n" + inert(self.labels(tree, n), limit=1024))
        self.query_one("#tree-detail", Static).update(t)

    # --- from the map to the tree -----------------------------------------------------------------
    @on(BlockMap.CellSelected)
    def _on_cell(self, msg: BlockMap.CellSelected) -> None:
        """The map's cursor (or a click) on a cell: remember it; `f` goes to its node."""
        msg.stop()
        bm = msg.blockmap
        if bm is None or bm.id != "tree-map" or not bm.has_focus:
            return  # the map moved to show a node's blocks: not the user's pick
        self._cell = (msg.block_id + bm.offset, msg.blocks)
        found = self._cell_key(*self._cell)
        what = "holds no cached prefix" if found is None else "f: its node in the tree"
        self.query_one("#tree-detail", Static).update(
            Text(f"block {self._cell[0]}{'+' if msg.blocks > 1 else ''} · {what}", style="dim"))

    def _cell_key(self, first: int, count: int):
        for b in range(first, first + min(count, 4096)):
            found = self.source.key_of(b)
            if found is not None:
                return found
        return None

    def action_find_block(self) -> None:
        cell = getattr(self, "_cell", None)
        if cell is None:
            bm = self.query_one(BlockMap)
            cell = (bm.cell_blocks(bm.cursor)[0] + bm.offset, bm.cell_blocks(bm.cursor)[1]) if bm.num_blocks else (0, 0)
        self.find_block(*cell)

    def find_block(self, block_id: int, count: int = 1) -> bool:
        """Open the tree down to the node holding `block_id` (or the first cached block of the
        `count` from it) and put the cursor on it."""
        found = self._cell_key(block_id, count)
        tree = self.trees.get(found[0]) if found else None
        node = tree.node_of(found[1]) if tree is not None else None
        if node is None:
            self.notify(f"block {block_id} holds no cached prefix", timeout=3)
            return False
        for n in tree.path(node):
            self._reveal.add((found[0], n.keys[0]))
        for n in tree.path(node)[:-1]:
            self._open.add((found[0], n.keys[0]))
        self.populate()
        tn = self._restore_cursor(("node", found[0], node))
        if tn is not None:
            self.show_node(found[0], node)
        self.query_one(Tree).focus()
        return True

    def _restore_cursor(self, data) -> None:
        widget = self.query_one(Tree)
        want = (data[1], data[2].keys[0]) if data[0] == "node" else None

        def walk(tn):
            for c in tn.children:
                d = c.data
                if d and d[0] == "node" and (d[1], d[2].keys[0]) == want:
                    return c
                hit = walk(c) if c.is_expanded else None
                if hit is not None:
                    return hit
            return None

        tn = walk(widget.root) if want else None
        if tn is not None:
            widget.move_cursor(tn)
        return tn

    def action_open_node(self) -> None:
        tn = self.query_one(Tree).cursor_node
        if tn is not None and tn.allow_expand and not tn.is_expanded:
            tn.expand()
        elif tn is not None and tn.data and tn.data[0] == "more":
            self.query_one(Tree).action_select_cursor()

    def action_close_node(self) -> None:
        widget = self.query_one(Tree)
        tn = widget.cursor_node
        if tn is None:
            return
        if tn.is_expanded:
            tn.collapse()
        elif tn.parent is not None and tn.parent is not widget.root:
            widget.move_cursor(tn.parent)

    def action_focus_map(self) -> None:
        self.query_one(BlockMap).focus()

    def action_close(self) -> None:
        self.app.pop_screen()
