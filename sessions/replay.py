"""Replay recorded turns through a fresh Engine's normal submit path and compare the outputs.

Each recorded turn is re-submitted with its recorded messages (so every turn is compared on
the same prompt even when an earlier reply changed), user, group and sampling (seed included),
in recorded order: turns that had an `at` keep it; with `speed`, every turn is submitted at
its recorded offset divided by `speed`. The engine changes recorded during the session
(settings, clears, groups: query.settings_timeline) are made again before the turn that
followed them.

A turn reproduces when its output tokens and its cache are what they were: the same cached
tokens, from the same creators, and the same reasons for the tokens it computed (per reason,
and where it diverged: engine/miss.py). A replay that matches the text but not the cache does
not reproduce the session. Turns recorded before kvplay explained misses have no reasons to
compare: there the cached tokens and creators decide alone. A keyed server's misses were
explained from each sender's own keys (`own_keys`): the replay explains them so too.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from dataclasses import dataclass
from typing import Iterator

from kvplay.engine.errors import EngineError
from kvplay.engine.miss import same_reasons
from kvplay.engine.sampling_params import SamplingParams

from .player import Done, Job, play
from .query import submit_order

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@dataclass
class Comparison:
    seq: int
    user: str
    text: str
    equal: bool  # the output tokens match (and neither run failed)
    first_diff: int | None  # first differing output token index (None when equal)
    then_token: str | None  # decoded tokens at that index (None past the end)
    now_token: str | None
    then_ids: list[int]
    now_ids: list[int]
    then_reply: str
    now_reply: str | None
    cached_then: int | None
    cached_now: int | None
    cached_from_then: dict
    cached_from_now: dict
    ttft_then: float | None
    ttft_now: float | None
    error: str | None
    done: Done
    cache_equal: bool = True  # cached tokens and their creators match (and the miss reasons, when recorded)
    miss_then: dict | None = None
    miss_now: dict | None = None
    miss_equal: bool = True  # the reasons per computed token match (True when the recording has none)

    @property
    def reproduces(self) -> bool:
        return self.equal and self.cache_equal

    def to_dict(self) -> dict:
        d = {"turn": self.seq}
        d.update((k, v) for k, v in dataclasses.asdict(self).items() if k not in ("seq", "done", "then_ids", "now_ids"))
        for k in ("miss_then", "miss_now"):  # the reasons, not the spans
            if d[k] is not None:
                d[k] = {x: d[k].get(x) for x in ("tokens", "reasons", "diverged_at")}
        d["reproduces"] = self.reproduces
        for k in ("ttft_then", "ttft_now"):
            d[k] = None if d[k] is None else round(d[k], 2)
        return d


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def recorded_jobs(turns: list[dict], speed: float | None = None, changes: dict | None = None) -> list[Job]:
    """The recorded turns as player jobs, in submit order; `changes` ({seq: Changes}, from
    query.settings_timeline) makes the engine changes recorded before a turn again before it."""
    t0 = min((t["started"] for t in turns if t.get("started") is not None), default=0.0)
    jobs = []
    for t in submit_order(turns):
        s = SamplingParams(**{k: v for k, v in (t["sampling"] or {}).items() if k in _SAMPLING_FIELDS})
        at = t.get("at")
        if speed is not None and t.get("started") is not None:
            at = max(0.0, t["started"] - t0)
        prompt = None
        if not t["messages"] and t.get("prompt_ids"):  # a completion turn: its token ids as sent
            prompt = (list(t["prompt_ids"]), t.get("system_tokens") or 0)
        ch = (changes or {}).get(t["seq"])
        jobs.append(Job(t["seq"], t["user"], t["text"], s, at=at, messages=t["messages"], prompt=prompt,
                        group=ch.group if ch else None, clear=bool(ch and ch.clear),
                        engine=(ch.engine or None) if ch else None))
    return jobs


def compare(turn: dict, done: Done, tokenizer) -> Comparison:
    res = done.result
    now_ids = list(res.token_ids) if res is not None else []
    then_ids = list(turn.get("token_ids") or [])
    err = done.error
    diff = first_difference(then_ids, now_ids)
    equal = diff is None and err is None and not turn.get("error")

    def tok(ids, i):
        if i is None or i >= len(ids):
            return None
        try:
            return tokenizer.decode([ids[i]])
        except Exception:
            return str(ids[i])

    st = res.stats if res is not None else None
    cached_now = st.cached_tokens if st else None
    from_then = turn.get("cached_from") or {}
    from_now = dict(st.cached_from) if st else {}
    miss_then, miss_now = turn.get("miss"), st.miss if st else None
    miss_equal = miss_then is None or same_reasons(miss_then, miss_now)
    cache_equal = err is None and turn.get("cached_tokens") == cached_now and from_then == from_now and miss_equal
    return Comparison(
        seq=turn["seq"], user=turn["user"], text=turn["text"], equal=equal, first_diff=diff,
        then_token=tok(then_ids, diff), now_token=tok(now_ids, diff), then_ids=then_ids, now_ids=now_ids,
        then_reply=turn.get("reply") or "", now_reply=res.text if res else None,
        cached_then=turn.get("cached_tokens"), cached_now=cached_now,
        cached_from_then=from_then, cached_from_now=from_now,
        ttft_then=turn.get("ttft_ms"), ttft_now=st.ttft_ms if st else None, error=err, done=done,
        cache_equal=cache_equal, miss_then=miss_then, miss_now=miss_now, miss_equal=miss_equal)


def replay(engine, turns: list[dict], system: str = "", groups: dict | None = None, speed: float | None = None,
           recorder=None, changes: dict | None = None) -> Iterator[Comparison]:
    """Re-drive `turns` (rows from query.session_turns) through `engine`; yield a Comparison per
    finished turn, in finish order. `groups`: each user's group when the session began;
    `changes`: {seq: Changes} made during it (query.settings_timeline), made again before those
    turns. With `recorder`, each new turn is recorded as it finishes."""
    for name, group in (groups or {}).items():  # the recorded users, in their starting groups
        engine.register_user(name, group)
    jobs = recorded_jobs(turns, speed, changes)
    by_seq = {t["seq"]: t for t in turns}
    out: "queue.Queue" = queue.Queue()
    failure: list[BaseException] = []

    def finished(done: Done) -> None:
        done.record(recorder)
        out.put(compare(by_seq[done.job.turn], done, engine.tokenizer))

    def drive() -> None:
        try:
            play(engine, jobs, system, finished, speed or 1.0)
        except BaseException as exc:
            failure.append(exc)
        finally:
            out.put(None)

    # misses explained as the recording explained them: a keyed server's from each sender's own
    # keys (`own_keys`), so that the reasons compare
    across = engine.miss_across_keys
    own_keys = across and any((t.get("miss") or {}).get("own_keys") for t in turns)
    if own_keys:
        engine.set_miss_across_keys(False)
    try:
        threading.Thread(target=drive, name="kvplay-replay", daemon=True).start()
        while True:
            item = out.get()
            if item is None:
                break
            yield item
    finally:
        if own_keys:
            try:
                engine.set_miss_across_keys(True)
            except EngineError:  # (a replay cut short after its engine shut down: nothing to restore)
                pass
    if failure:
        raise failure[0]


def replay_summary(comps: list[Comparison], turns: list[dict], recorded_det: bool, strict: bool) -> dict:
    """What a replay's comparisons add up to: counts, whether the cache was compared and whether
    the session reproduces; `failed` is the exit code's claim (a turn failed, or a session
    recorded and replayed in deterministic mode gave other output tokens)."""
    errors = sum(1 for c in comps if c.error)
    text_differs = sum(1 for c in comps if not c.equal and not c.error)
    cache_differs = sum(1 for c in comps if not c.cache_equal and not c.error)
    miss_differs = sum(1 for c in comps if not c.miss_equal and not c.error)  # (counted in cache_differs too)
    # When turns overlapped (`at`), arrival order decides who computes a shared block, so who is
    # credited (and how much hits) can change from run to run: then a cache difference is shown
    # and counted, but the verdict rests on the outputs alone (`cache_compared` says which).
    cache_compared = not any(t.get("at") is not None for t in turns)
    same = sum((c.reproduces if cache_compared else c.equal) for c in comps)
    differs = len(comps) - same
    return {"turns": len(comps), "equal": same, "differs": differs, "text_differs": text_differs,
            "cache_differs": cache_differs, "miss_differs": miss_differs, "cache_compared": cache_compared,
            "errors": errors,
            "deterministic": recorded_det, "reproduces": differs == 0,
            "failed": errors > 0 or (strict and text_differs > 0)}
