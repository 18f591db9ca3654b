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

from kvplay.engine.sampling import SamplingParams

from .common import LabContext, LabResult, Table

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
                     f"{b.stats.cached_tokens}/{b.stats.prompt_tokens} {b.stats.cached_from or ''}".strip(),
                     b.text == c])
    rc_texts = [a["text"] for a in with_rc]
    kv_texts = [r.text for r in kv]
    summary = {
        "response_cache_identical": len(set(rc_texts)) == 1,
        "response_cache_engine_calls": sum(a["engine_called"] for a in with_rc),
        "kv_distinct_answers": len(set(kv_texts)),
        "kv_identical": len(set(kv_texts)) == 1,
        "kv_cached_tokens": [r.stats.cached_tokens for r in kv],
        "kv_prompt_tokens": kv[0].stats.prompt_tokens if kv else 0,
        "kv_equals_cold": [r.text == c for r, c in zip(kv, cold)],
    }
    n = len(people)
    verdict = (
        f"Response cache: {n if summary['response_cache_identical'] else 'not all'} of {n} users got "
        f"{p.users[0]}'s answer verbatim ({summary['response_cache_engine_calls']} engine call). "
        f"KV prefix cache: {summary['kv_distinct_answers']} distinct answers from {n} seeds at temperature "
        f"{p.temperature}, while users after the first reused "
        f"{', '.join(str(c) for c in summary['kv_cached_tokens'][1:])} of {summary['kv_prompt_tokens']} prompt "
        f"tokens from the cache; {sum(summary['kv_equals_cold'])}/{n} answers equal the same seed on a cold "
        f"cache. \"The first user's answer is what everyone gets\" is true of a response cache, not of a "
        f"KV prefix cache.")
    tables = [Table(f"{p.question!r} at temperature {p.temperature}, own seed per user",
                    ["user", "seed", "response cache: answer", "source", "KV prefix cache: answer",
                     "cached/prompt tokens (from)", "= cold answer"], rows)]
    data = {"params": p.__dict__, "response_cache": with_rc,
            "kv_cache": [{"user": r.user, "text": r.text, **r.stats.to_dict()} for r in kv],
            "cold": cold, "summary": summary}
    return LabResult("response-cache", verdict, tables, data, eng.model_name, eng.config.to_dict(),
                     time.perf_counter() - t_start)


def plot(result: LabResult, path: str) -> None:
    from .common import pyplot

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
