"""Lab: a response cache is not a KV prefix cache.

The claim "the first user's answer is what everyone gets" describes a **response cache**: the
whole answer stored under the prompt text and returned verbatim. ``ResponseCache`` below is such
a layer (lab-side, in front of the engine). Three users ask the same question with their own
seeds at temperature > 0: through the response cache all get the first user's answer; through
the engine's KV prefix cache alone, the prompt's computation is reused (cached tokens > 0) but
each answer is sampled from its own seed — and equals what that seed gives on a cold cache.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from kvplay.engine.sampling_params import SamplingParams

from . import stats
from .common import LabContext, LabResult, Table, cached_cell, pyplot

QUESTION = "Am I pretty?"


class ResponseCache:
    """Whole answers keyed by the conversation text (what a semantic/response cache does)."""

    def __init__(self, engine, ctx: LabContext | None = None):
        self.engine = engine
        self.ctx = ctx or LabContext()
        self.answers: dict[str, tuple[str, str]] = {}  # key -> (answer, user who caused it)

    @staticmethod
    def key(messages: list[dict]) -> str:
        return json.dumps(messages, sort_keys=True)

    def ask(self, user: str, messages: list[dict], sampling: SamplingParams) -> dict:
        k = self.key(messages)
        if k in self.answers:
            text, origin = self.answers[k]
            return {"text": text, "source": f"response cache ({origin}'s answer)", "cached_tokens": None,
                    "prompt_tokens": None, "engine_called": False}
        res = self.engine.submit(user, messages, sampling).result(600)
        self.ctx.record(user, messages, sampling, res)
        self.answers[k] = (res.text, user)
        return {"text": res.text, "source": "generated", "cached_tokens": res.stats.cached_tokens,
                "prompt_tokens": res.stats.prompt_tokens, "cached_from": res.stats.cached_from,
                "engine_called": True}


@dataclass
class ResponseCacheParams:
    question: str = QUESTION
    users: list[str] = field(default_factory=lambda: ["alice", "bob", "carol"])
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    temperature: float = 0.8
    max_tokens: int = 32


def run(eng, params: ResponseCacheParams | None = None, ctx: LabContext | None = None) -> LabResult:
    p = params or ResponseCacheParams()
    ctx = ctx or LabContext()
    t_start = time.perf_counter()
    msgs = [{"role": "user", "content": p.question}]
    old_isolation = eng.config.isolation
    eng.reconfigure(isolation="shared")
    people = list(zip(p.users, p.seeds))
    sp = {u: SamplingParams(temperature=p.temperature, max_tokens=p.max_tokens, seed=s) for u, s in people}
    ctx.phase("asking", 3 * len(people))
    eng.clear_cache()
    rc = ResponseCache(eng, ctx)
    with_rc = []
    for u, _ in people:
        with_rc.append(rc.ask(u, msgs, sp[u]))
        ctx.advance()
    eng.clear_cache()
    kv = []
    for u, _ in people:
        res = eng.submit(u, msgs, sp[u]).result(600)
        ctx.record(u, msgs, sp[u], res)
        kv.append(res)
        ctx.advance()
    cold = []  # each seed alone on an empty cache: what the KV-cached answer should equal
    for u, _ in people:
        eng.clear_cache()
        res = eng.submit(u, msgs, sp[u]).result(600)
        ctx.record(u, msgs, sp[u], res)
        cold.append(res.text)
        ctx.advance()
    eng.reconfigure(isolation=old_isolation)
    ctx.progress.close()
    rows = []
    for (u, s), a, b, c in zip(people, with_rc, kv, cold):
        rows.append([u, s, a["text"], a["source"], b.text,
                     cached_cell(b.stats.cached_tokens, b.stats.prompt_tokens, b.stats.cached_from, u),
                     b.text == c])
    rc_texts = [a["text"] for a in with_rc]
    kv_texts = [r.text for r in kv]
    summary = {
        "users": list(p.users), "temperature": p.temperature,
        "response_cache_texts": rc_texts, "kv_texts": kv_texts, "cold_texts": cold,
        "response_cache_identical": len(set(rc_texts)) == 1,
        "response_cache_engine_calls": sum(a["engine_called"] for a in with_rc),
        "kv_distinct_answers": len(set(kv_texts)),
        "kv_identical": len(set(kv_texts)) == 1,
        "kv_cached_tokens": [r.stats.cached_tokens for r in kv],
        "kv_prompt_tokens": kv[0].stats.prompt_tokens if kv else 0,
        "kv_equals_cold": [r.text == c for r, c in zip(kv, cold)],
    }
    got_first = sum(1 for x in rc_texts[1:] if rc_texts and x == rc_texts[0])
    summary["response_cache_got_first_ci"] = stats.clopper_pearson(got_first, len(people) - 1)
    summary["kv_equals_cold_ci"] = stats.clopper_pearson(sum(summary["kv_equals_cold"]), len(people))
    verdict = make_verdict(summary)
    tables = [Table(f"“{p.question}” at temperature {p.temperature}, own seed per user",
                    ["user", "seed", "response cache: answer", "source", "KV prefix cache: answer",
                     "cached/prompt tokens (from)", "= cold answer"], rows)]
    data = {"params": p.__dict__, "response_cache": with_rc,
            "kv_cache": [{"user": r.user, "text": r.text, **r.stats.to_dict()} for r in kv],
            "cold": cold, "summary": summary}
    return LabResult("response-cache", verdict, tables, data, eng.model_name, eng.config.to_dict(),
                     time.perf_counter() - t_start)


def served_first(summary: dict) -> list[bool]:
    """For each user after the first: did it get the first user's answer *because of the cache*
    (the first user's text, while its own seed alone, on a cold cache, gives another)?"""
    kv, cold = summary["kv_texts"], summary["cold_texts"]
    return [kv[i] == kv[0] and cold[i] != kv[0] for i in range(1, len(kv))]


def _ci(k: int, n: int) -> str:
    """The rate's 95 % Clopper-Pearson interval: with a handful of users it is wide, and says so."""
    if n <= 0:
        return ""
    lo, hi = stats.clopper_pearson(k, n)
    return f"; 95 % CI of the rate {100 * lo:.0f}–{100 * hi:.0f} %"


def make_verdict(summary: dict) -> str:
    """The verdict; every clause is decided by the measurements in `summary` (see run())."""
    users, t = summary["users"], summary["temperature"]
    n, first = len(users), users[0]
    rc = summary["response_cache_texts"]
    rc_got_first = sum(1 for x in rc[1:] if x == rc[0])
    calls = summary["response_cache_engine_calls"]
    parts = [f"Response cache: {rc_got_first} of {n - 1} later users got {first}'s answer verbatim "
             f"({calls} engine call{'' if calls == 1 else 's'} for {n} users{_ci(rc_got_first, n - 1)})."]
    cached = summary["kv_cached_tokens"][1:]
    reuse = (f"reused {', '.join(str(c) for c in cached)} of {summary['kv_prompt_tokens']} prompt tokens"
             if cached else "had no one to reuse from")
    eq_cold = sum(summary["kv_equals_cold"])
    distinct = summary["kv_distinct_answers"]
    parts.append(f"KV prefix cache: {distinct} distinct answer{'' if distinct == 1 else 's'} from {n} seeds at "
                 f"temperature {t:g}; users after the first {reuse}; {eq_cold}/{n} answers equal the same seed "
                 f"on a cold cache{_ci(eq_cold, n)}.")
    kv_first = served_first(summary)
    rc_true = n > 1 and rc_got_first == n - 1
    kv_true = bool(kv_first) and all(kv_first)
    claim = "“The first user's answer is what everyone gets”"
    if kv_true:
        parts.append(f"{claim} held for the KV prefix cache" + (" and for the response cache" if rc_true else
                     ", not for the response cache") + f": every later user got {first}'s answer through the KV "
                     "cache, which its own seed does not give on a cold cache.")
        return " ".join(parts)
    if any(kv_first):
        why = f"only {sum(kv_first)} of {n - 1} later users got {first}'s answer through it"
    elif eq_cold == n:
        why = "it shared the prompt's computation, and every answer is what the user's own seed gives on a cold cache"
    else:
        why = (f"no later user got {first}'s answer through it, but {n - eq_cold} of {n} answers differ from the "
               "same seed on a cold cache, so the cache changed outputs in another way")
    held = "held for the response cache but" if rc_true else "held for neither cache:"
    parts.append(f"{claim} {held} not for the KV prefix cache: {why}.")
    return " ".join(parts)


def plot(result: LabResult, path: str) -> None:
    plt = pyplot()
    kv = result.data["kv_cache"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    users = [k["user"] for k in kv]
    cached = [k["cached_tokens"] for k in kv]
    computed = [k["prompt_tokens"] - k["cached_tokens"] for k in kv]
    ax.bar(users, cached, label="prompt tokens from cache")
    ax.bar(users, computed, bottom=cached, label="prompt tokens computed")
    ax.set(ylabel="tokens", title="KV prefix cache: computation reused, answers each user's own")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
