"""The playground attached to a remote server (`kvplay attach`): the same KvplayApp, whose
backend is a `RemoteBackend` (wire/remote.py) instead of an in-process engine.

What a remote server decides for itself (isolation, eviction, determinism, groups; labs run on
kvplay's own engine) its backend's `Controls` say (wire/remote.remote_controls): the app's keys
answer those with one line, and F4 asks the server to reset its prefix cache. The cache room
(`AttachCacheRoom`) shows each pod's state (waiting / live / replaying / stale) and its blocks in
the status panel, one map per pod, and in the stats panel what the server's `usage` and KV events
tell (no memory figures: the server's pool is not ours to weigh). The server's words (its model
id, pod names from its discovery answers) are shown inert (kvplay/inert.py).
"""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvplay.engine.config import EngineConfig
from kvplay.inert import inert
from kvplay.wire.remote import PodRange

from .app import KvplayApp
from .blockmap import BlockMap
from .cache_room import CacheRoom
from .panes import safe_id
from .tree_view import FleetTrees

DIM = "dim"
POD_STYLE = {"live": "bold green", "replaying": "bold yellow", "stale": "bold red", "waiting": "bold"}


class AttachCacheRoom(CacheRoom):
    """The cache room over a RemoteBackend: a map per pod, the pods' states, the server's counters."""

    def maps_ready(self) -> None:
        """A fleet: one map per pod (each its own scale, zoom and filter), titled by the pod; the
        status panel gives each pod's state and blocks, the stats panel the totals."""
        pods = list(self.backend.pods)
        if len(pods) < 2:
            return
        first = self.query_one("#map", BlockMap)
        first.label = f"pod {pods[0]}"
        first.set_source(PodRange(self.backend, pods[0]), self.looks)
        after = first
        for name in pods[1:]:
            pid = f"map-pod-{safe_id(name)}"
            title = Static(Text(f"pod {inert(name, limit=256)}", style="bold"), classes="section", id=f"{pid}-title")
            bm = BlockMap(label=f"pod {name}", id=pid, classes="podmap")
            self.mount(title, bm, after=after)
            bm.set_source(PodRange(self.backend, name), self.looks)
            after = bm

    def tree_source(self):
        """The tree of the server's mirrored cache (the backend's Fleet), text from /detokenize."""
        return FleetTrees(self.backend)

    # --- what the panels say --------------------------------------------------------------
    def status_view(self, stats: dict) -> Text:
        b = self.backend
        t = Text()
        t.append(inert(b.model_name, limit=256), style="bold")
        t.append(f" at {inert(b.url, limit=256)}", style=DIM)
        if not b.pods:
            t.append("\nno KV events (--events): the map stays empty; each turn's badge shows the "
                     "cached tokens the server's usage reports", style=DIM)
            return t
        size = f" × {stats['block_size']} tokens" if stats.get("block_size") else ""
        t.append(f"\n{b.num_blocks:,} slots{size}, mirrored from KV events", style=DIM)
        many = len(b.pods) > 1
        for name, slots in list(b.pods.items()):
            state = stats.get("pods", {}).get(name, "waiting")
            t.append(f"\npod {inert(name, limit=256)} ", style=DIM)
            t.append(state, style=POD_STYLE.get(state, "bold"))
            t.append(f" · {len(slots.key_slot):,} blocks", style=DIM)
            trouble = stats.get("pod_trouble", {}).get(name)
            if trouble:  # why the pod may be stale: lost batches, bad payloads or events, other tiers
                t.append(" · " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in trouble.items()),
                         style="yellow")
            if many:
                t.append(f" · map {slots.offset:,}–{slots.offset + slots.num_blocks - 1:,}", style=DIM)
        return t

    def stats_view(self, stats: dict) -> Text:
        t = Text()
        t.append("hit rate ", style=DIM)
        t.append(f"{stats['hit_rate'] * 100:.0f}%", style="bold")
        t.append(f"  ({stats['hit_tokens']:,} of {stats['query_tokens']:,} prompt tokens of these panes "
                 "cached, from usage)\n", style=DIM)
        t.append("blocks   ", style=DIM)
        if self.backend.pods:
            t.append(f"cached {stats['blocks_cached']:,}")
            t.append(f" (all pods) · removed {stats['evictions']:,}", style=DIM)
        else:
            t.append("not mirrored (no --events)", style=DIM)
        t.append("\nrequests ", style=DIM)
        t.append(f"{stats['requests_finished']:,}")
        t.append(" finished from these panes", style=DIM)
        if stats.get("predicted_turns"):
            t.append("\npredicted ", style=DIM)
            t.append(f"{stats['predicted_turns'] - stats['mispredicted_turns']:,} of {stats['predicted_turns']:,}")
            t.append(" turns' cached tokens as the mirror said", style=DIM)
            if stats["mispredicted_turns"]:
                t.append(f" · {stats['mispredicted_turns']:,} differ", style="bold red")
        if stats.get("unpredictable_turns"):  # the server's salt decided, before we had learned it
            t.append(f"\n{stats['unpredictable_turns']:,} salted turns not predicted (salt not learned yet)", style=DIM)
        return t


class AttachApp(KvplayApp):
    """KvplayApp over an open RemoteBackend (opened by the CLI, so a bad URL never opens the app)."""

    CACHE_ROOM = AttachCacheRoom
    SUB_TITLE = "attached to a server's shared KV cache"

    def __init__(self, backend, users, system_prompt: str, turns=None, speed: float = 1.0,
                 db: str | None = None, record: bool = True, title: str | None = None,
                 timings: bool = True) -> None:
        super().__init__(EngineConfig(model=backend.model_name), users, system_prompt, turns=turns, speed=speed,
                         db=db, record=record, title=title or f"attached to {backend.url}", timings=timings)
        self._remote = backend

    def open_backend(self):
        self.cache.listen(self._remote)
        return self._remote
