"""`GET /metrics`: Prometheus text, with vLLM's metric names where they mean the same thing.

vLLM's (labels ``model_name``, ``engine``): prefix-cache queries and hits in tokens,
prompt tokens cached, KV-cache usage (a fraction, as vLLM reports it), preemptions, requests
running/waiting, prompt and generation tokens, finished requests by reason.
kvplay's own (``kvplay:``): cached tokens by the user who created the blocks and the user who
reused them, evictions, blocks by state, and prompt tokens computed by miss reason
(``kvplay:prefix_cache_miss_tokens_total{reason}``, engine/miss.py; labelled by reason only,
never by user or content; a scrape that may not see the per-user series counts `isolated`
tokens as `cold`, since a rising `isolated` count would tell a tenant that another one holds
the tokens it just sent).
"""
from __future__ import annotations

import threading
from collections import defaultdict

from kvplay.engine.events import BlockHit, MissExplained, RequestFinished
from kvplay.engine.miss import REASONS


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: dict) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}"


class ServerMetrics:
    """Counters fed by the engine's event batches (on the engine thread: only adds numbers)."""

    def __init__(self, engine):
        self._lock = threading.Lock()
        self.cached_by = defaultdict(int)  # (creator, user) -> tokens
        self.prompt_cached = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = defaultdict(int)  # finish reason -> requests
        self.miss = dict.fromkeys(REASONS, 0)  # miss reason -> prompt tokens computed
        self._unsub = engine.subscribe_batches(self._on_batch)

    def close(self) -> None:
        self._unsub()

    def _on_batch(self, batch) -> None:
        for ev in batch.events:
            cls = type(ev)
            if cls is BlockHit:
                with self._lock:
                    for creator, n in ev.by_creator.items():
                        self.cached_by[(creator, ev.user)] += n
            elif cls is MissExplained:
                with self._lock:
                    for _, n, reason, _, _ in ev.spans:
                        if reason in self.miss:
                            self.miss[reason] += n
            elif cls is RequestFinished:
                st = ev.stats or {}
                with self._lock:
                    self.prompt_tokens += st.get("prompt_tokens") or 0
                    self.prompt_cached += st.get("cached_tokens") or 0
                    self.generation_tokens += st.get("output_tokens") or 0
                    self.finished[ev.finish_reason] += 1

    def snapshot(self) -> dict:
        """The counters, copied (plain data: it crosses from the engine-core process)."""
        with self._lock:
            return {"cached_by": [(c, u, n) for (c, u), n in sorted(self.cached_by.items())],
                    "finished": dict(self.finished), "prompt_tokens": self.prompt_tokens,
                    "prompt_cached": self.prompt_cached, "generation_tokens": self.generation_tokens,
                    "miss": dict(self.miss)}


def render(stats: dict, snap: dict, model_name: str, users: bool = True) -> str:
    """Prometheus text from the engine's stats and ServerMetrics.snapshot(); `users=False`
    leaves out the per-user series (who reuses whose cache), which only the operator may see
    on a server with keys."""
    base = {"model_name": model_name, "engine": "0"}
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{_labels({**base, **labels})} {float(value)!r}")

    total = stats.get("blocks_total") or 0
    used = total - (stats.get("blocks_free") or 0) - (stats.get("blocks_cached") or 0)
    cached_by = {(c, u): n for c, u, n in snap["cached_by"]}
    finished = snap["finished"]
    prompt_tokens, prompt_cached, gen = snap["prompt_tokens"], snap["prompt_cached"], snap["generation_tokens"]
    metric("vllm:prefix_cache_queries_total", "counter",
           "Prefix cache queries, in terms of number of queried tokens.", [({}, stats.get("query_tokens", 0))])
    metric("vllm:prefix_cache_hits_total", "counter",
           "Prefix cache hits, in terms of number of cached tokens.", [({}, stats.get("hit_tokens", 0))])
    metric("vllm:prompt_tokens_cached_total", "counter",
           "Number of cached prompt tokens (local prefix cache) of finished requests.", [({}, prompt_cached)])
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           [({}, used / total if total else 0.0)])
    metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions from the engine.",
           [({}, stats.get("preemptions", 0))])
    metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           [({}, stats.get("running", 0))])
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           [({}, stats.get("waiting", 0))])
    metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", [({}, prompt_tokens)])
    metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", [({}, gen)])
    metric("vllm:request_success_total", "counter", "Count of finished requests by finish reason.",
           [({"finished_reason": r}, n) for r, n in sorted(finished.items())] or [({"finished_reason": "stop"}, 0)])
    if users:
        metric("kvplay:cached_tokens_total", "counter",
               "Prompt tokens served from the cache, by the user who created the blocks and the user who reused them.",
               [({"creator": c, "user": u}, n) for (c, u), n in sorted(cached_by.items())])
    miss = dict.fromkeys(REASONS, 0)
    miss.update({k: v for k, v in (snap.get("miss") or {}).items() if k in miss})
    if not users:  # that another tenant holds these tokens is what isolation hides
        miss["cold"] += miss.pop("isolated")
    metric("kvplay:prefix_cache_miss_tokens_total", "counter",
           "Prompt tokens not served from the prefix cache, by why they were computed (first admission).",
           [({"reason": r}, n) for r, n in miss.items()])
    metric("kvplay:evictions_total", "counter", "Cached blocks evicted.", [({}, stats.get("evictions", 0))])
    metric("kvplay:collisions_caught_total", "counter", "Hash hits whose stored tokens did not match.",
           [({}, stats.get("collisions_caught", 0))])
    metric("kvplay:blocks", "gauge", "KV blocks by state.",
           [({"state": s}, stats.get("blocks_" + s, 0)) for s in ("free", "cached", "in_use")])
    return "\n".join(lines) + "\n"
