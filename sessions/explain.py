"""Why a whole session's (or trace's) prompt tokens missed the cache, and what would fix it:
`kvplay explain`'s analysis (the command: kvplay/commands/explain.py).

- **missed tokens by reason**, over every request, from the miss objects (engine/miss.py): a
  session of kvplay's own engine has them recorded (its MissExplained events); a trace file or
  a watched server's recording gets them from the simulator, which runs the engine's scheduler,
  KV manager and pool, and so its attribution (sessions/simulate.py). A keyed server's turns
  were explained from their sender's own keys (`own_keys`): their cold tokens that the
  simulation finds under another key are renamed as it names them (`across_keys`).
- **cache breakers**: a prompt position where several requests diverge from an otherwise shared
  prefix (same tokens before it, different tokens in a short span, the same tokens again for at
  least a block after it): a timestamp, a request id, a reordered tool list. Each with the text
  around it (decoded with the session's tokenizer when it is on this machine) and the tokens
  the requests that diverged there computed.
- **evictions** by who evicted whom (victim, evicting user, tokens) and **isolation** cost (user,
  whose blocks would have hit, tokens).
- **projected hit rate if fixed**, each by simulating the same trace changed accordingly, next to
  the same simulation of the trace as recorded (never guessed): the breaker removed (every
  prompt with the breaker's prefix gets the most common variant of its span, ties to the first
  seen, and the rest of its own prompt), a bigger pool (twice the recorded one, and one large
  enough never to evict), `shared` isolation, and no clears or reconfigures.

A span is found by realigning each prompt with the first one that has the breaker's prefix: the
shortest pair of skips after which RESYNC tokens agree again, repeated over short agreements
(a request id, then " at 2026-12-05T10:00:0", then the seconds: one span), until the two agree
for two blocks (at most MAX_SPAN tokens each side). So a user's new question, followed only by
the chat template's few closing tokens, is no breaker.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from kvplay.engine.miss import REASONS, empty_reasons, miss_object

from .simulate import Clear, SimResult, Trace, simulate

RESYNC = 8  # tokens that must agree again after a breaker's span
MAX_SPAN = 128  # the longest span looked at, on each side
TOP = 3  # breakers reported (each costs a simulation)
MAX_POOL = 1 << 20  # the largest pool a "never evicts" projection simulates
CONTEXT_TOKENS = 12  # tokens decoded on each side of a breaker
CONTEXT_CHARS = 30


@dataclass
class Turn:
    number: int  # the turn's seq in a session, else its position in the trace (1-based)
    request_id: str
    user: str
    prompt_tokens: int
    cached_tokens: int
    miss: dict | None


@dataclass
class Breaker:
    at: int  # the first differing prompt position
    requests: list[str]  # the requests that diverged there
    tokens: int  # the diverged tokens they computed
    span: int  # tokens of the reference prompt's variant
    before: list[int]
    variants: list[tuple[tuple, int]]  # (tokens, how many prompts have it), most common first
    after: list[int]
    rewrite: dict[str, list[int]] = field(default_factory=dict)  # request id -> prompt without the breaker
    projected: SimResult | None = None


def _resync(r: list[int], i: int, ref: list[int], j: int) -> tuple[int, int] | None:
    """The shortest (skip in r from i, skip in ref from j) after which RESYNC tokens agree."""
    grams: dict[tuple, int] = {}
    for b in range(MAX_SPAN + 1):
        g = tuple(ref[j + b:j + b + RESYNC])
        if len(g) < RESYNC:
            break
        grams.setdefault(g, b)
    best = None
    for a in range(MAX_SPAN + 1):
        if best is not None and a > best[0] + best[1]:
            break
        g = tuple(r[i + a:i + a + RESYNC])
        if len(g) < RESYNC:
            break
        b = grams.get(g)
        if b is not None and (best is None or a + b < best[0] + best[1]):
            best = (a, b)
    return best


def _span(r: list[int], ref: list[int], d: int, agree: int) -> tuple[int, int] | None:
    """(tokens of r, tokens of ref) from d that differ, short agreements inside included: the
    span ends where the two agree again for at least `agree` tokens (None: not within MAX_SPAN)."""
    ta = tb = 0
    while True:
        ab = _resync(r, d + ta, ref, d + tb)
        if ab is None:
            return None
        ta, tb = ta + ab[0], tb + ab[1]
        if ta > MAX_SPAN or tb > MAX_SPAN:
            return None
        n = _agree(r, d + ta, ref, d + tb)
        if n >= agree:
            return ta, tb
        ta, tb = ta + n, tb + n  # a short agreement (" at 2026-12-05T10:00:0"): the span goes on


def _agree(x: list[int], i: int, y: list[int], j: int) -> int:
    n = 0
    while i + n < len(x) and j + n < len(y) and x[i + n] == y[j + n]:
        n += 1
    return n


def find_breakers(trace: Trace, turns: list[Turn], top: int = TOP) -> list[Breaker]:
    """Positions where at least two requests diverged from the same prefix and realign after a
    short span, biggest cost first: the first `top` found, looking at the costliest candidate
    positions only (at most 4 x `top` + 16 of them: each costs a pass over the trace)."""
    agree = 2 * trace.config.block_size  # what "shared again" takes: two blocks
    prompts = {r.request_id: r.prompt_ids for r in trace.requests}
    groups: dict[tuple, list[Turn]] = {}
    for t in turns:
        m = t.miss
        d = m.get("diverged_at") if m else None
        p = prompts.get(t.request_id)
        if d is None or p is None or not 0 < d < len(p) or not m["reasons"].get("diverged"):
            continue
        groups.setdefault((d, hash(tuple(p[:d]))), []).append(t)
    out = []
    cands = sorted(((d, ms) for (d, _), ms in groups.items() if len(ms) >= 2),
                   key=lambda c: (-sum(t.miss["reasons"]["diverged"] for t in c[1]), c[0]))
    for d, members in cands[:4 * top + 16]:
        if len(out) >= top:
            break
        prefix = prompts[members[0].request_id][:d]
        same = [r for r in trace.requests if len(r.prompt_ids) > d and r.prompt_ids[:d] == prefix]
        ref = same[0].prompt_ids
        skips: dict[str, tuple[int, int]] = {}
        for r in same[1:]:
            if r.prompt_ids[d] == ref[d]:
                continue  # the reference's variant (placed below, once its span is known)
            ab = _span(r.prompt_ids, ref, d, agree)
            if ab is not None:
                skips[r.request_id] = ab
        if not skips:
            continue
        span = Counter(b for _, b in skips.values()).most_common(1)[0][0]
        variant = {same[0].request_id: tuple(ref[d:d + span])}
        cut = {same[0].request_id: span}
        for r in same[1:]:
            p = r.prompt_ids
            if r.request_id in skips:
                a = skips[r.request_id][0]
                variant[r.request_id], cut[r.request_id] = tuple(p[d:d + a]), a
            elif p[d:d + span] == ref[d:d + span] and _agree(p, d + span, ref, d + span) >= agree:
                variant[r.request_id], cut[r.request_id] = tuple(p[d:d + span]), span
        seen = [variant[r.request_id] for r in same if r.request_id in variant]  # in arrival order
        first = {}
        for i, v in enumerate(seen):
            first.setdefault(v, i)
        ranked = sorted(Counter(seen).items(), key=lambda kv: (-kv[1], first[kv[0]]))
        best = list(ranked[0][0])
        rewrite = {rid: prompts[rid][:d] + best + prompts[rid][d + cut[rid]:] for rid in variant}
        out.append(Breaker(d, [t.request_id for t in members], sum(t.miss["reasons"]["diverged"] for t in members),
                           span, prefix[-CONTEXT_TOKENS:], ranked, ref[d + span:d + span + CONTEXT_TOKENS], rewrite))
    out.sort(key=lambda b: (-b.tokens, b.at))
    return out


def _with_prompts(trace: Trace, rewrite: dict[str, list[int]]) -> Trace:
    items = [replace(it, prompt_ids=list(rewrite[it.request_id])) if not isinstance(it, Clear)
             and it.request_id in rewrite else it for it in trace.items]
    return replace(trace, items=items)


def _no_clears(trace: Trace) -> Trace:
    return replace(trace, items=[it for it in trace.items if not isinstance(it, Clear)])


def across_keys(recorded: dict, simulated: dict | None) -> tuple[dict, int]:
    """A miss object its engine explained from the sender's own keys only (`own_keys`: a keyed
    `kvplay serve`, which does not look across keys on the request's path), with the tokens it
    calls cold that the simulation of the same trace found under another key (isolated, or
    config by content) named as the simulation names them; (that object, the tokens renamed).
    Only a renaming: the counts still sum to the recorded uncached tokens."""
    theirs = sorted((sp[0], sp[0] + sp[1], sp[2], sp[3]) for sp in (simulated or {}).get("spans") or []
                    if sp[2] in ("isolated", "config"))
    if not theirs:
        return recorded, 0
    spans: list[list] = []
    renamed = j = 0  # (both in prompt order: one pass over each, whatever a recording holds)
    for start, n, reason, who, by in sorted(recorded.get("spans") or [], key=lambda sp: sp[0]):
        if reason != "cold":
            spans.append([start, n, reason, who, by])
            continue
        at, end = start, start + n
        while j < len(theirs) and theirs[j][1] <= at:
            j += 1
        k = j
        while k < len(theirs) and theirs[k][0] < end:
            a, b, why, whose = theirs[k]
            lo, hi = max(at, a), min(end, b)
            if lo < hi:
                if lo > at:
                    spans.append([at, lo - at, "cold", "", ""])
                spans.append([lo, hi - lo, why, whose, ""])
                renamed += hi - lo
                at = hi
            k += 1
        if at < end:
            spans.append([at, end - at, "cold", "", ""])
    if not renamed:
        return recorded, 0
    ex = recorded.get("excerpt") or None
    return miss_object(spans, recorded.get("diverged_at"), (ex["prompt"], ex["cached"]) if ex else None,
                       recorded.get("evicted_at"), recorded.get("eviction_policy"), recorded.get("cleared_at")), renamed


def _hit(res: SimResult) -> float:
    return round(res.hit_rate, 6)


def _text(detok, ids) -> str | None:
    if detok is None:
        return None
    try:
        return detok(list(ids))
    except Exception:  # ids this tokenizer does not know (a synthesized trace): ids instead
        return None


def _shown(detok, ids, side: str) -> str:
    t = _text(detok, ids)
    if t is None:
        return " ".join(map(str, ids))
    return t[-CONTEXT_CHARS:] if side == "left" else t[:CONTEXT_CHARS]


def explain(trace: Trace, recorded: dict[str, dict] | None = None, turn_numbers: dict[str, int] | None = None,
            detok=None, top: int = TOP) -> dict:
    """The report (JSON-ready): see the module docstring. `recorded`: request id -> miss object
    from the recording (missing ones come from the simulation); `turn_numbers`: request id ->
    the session's turn seq; `detok`: token ids -> text (None: ids are shown)."""
    base = simulate(trace)  # the trace as recorded, through the engine's attribution
    recorded = recorded or {}
    turns: list[Turn] = []
    sources = set()
    own = {"turns": 0, "renamed_turns": 0, "tokens": 0}  # turns explained from the sender's own keys
    for i, r in enumerate(trace.requests, 1):
        m = recorded.get(r.request_id)
        if m is not None and r.cached_tokens is not None:  # the live run's own account
            sources.add("recorded")
            cached = r.cached_tokens
            if m.get("own_keys"):  # what other keys held: from the simulation, where it agrees on the hit
                own["turns"] += 1
                if base.cached.get(r.request_id) == cached:
                    m, k = across_keys(m, base.miss.get(r.request_id))
                    own["renamed_turns"] += k > 0
                    own["tokens"] += k
        else:
            sources.add("simulated")
            m, cached = base.miss.get(r.request_id), base.cached.get(r.request_id, 0)
        turns.append(Turn((turn_numbers or {}).get(r.request_id, i), r.request_id, r.user, len(r.prompt_ids),
                          cached, m))
    reasons = empty_reasons()
    evicted: Counter = Counter()
    isolated: Counter = Counter()
    for t in turns:
        for k, n in ((t.miss or {}).get("reasons") or {}).items():
            if k in reasons:
                reasons[k] += n
        for who, n in ((t.miss or {}).get("evicted_by") or {}).items():
            evicted[(t.user, who)] += n
        for who, n in ((t.miss or {}).get("isolated_from") or {}).items():
            isolated[(t.user, who)] += n
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    report: dict = {
        "source": trace.source, "requests": len(turns), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
        "attribution": "recorded" if sources == {"recorded"} else "simulated" if sources == {"simulated"} else "mixed",
        "simulated_hit_rate": _hit(base),
        "missed": {"tokens": sum(reasons.values()), "reasons": reasons},
        # recorded turns explained from their sender's own keys (a keyed server): how many, how
        # many of them the simulation showed holding cold tokens under another key, those tokens
        "own_keys": own if own["turns"] else None,
    }
    # the breakers, each with its projection
    breakers = find_breakers(trace, turns, top)
    out_b = []
    for b in breakers:
        b.projected = simulate(_with_prompts(trace, b.rewrite))
        out_b.append({
            "at": b.at, "requests": len(b.requests), "tokens": b.tokens,
            "before": _shown(detok, b.before, "left"),
            "variants": [{"text": _shown(detok, v, "right") if v else "", "count": n} for v, n in b.variants[:5]],
            "more_variants": max(0, len(b.variants) - 5),
            "after": _shown(detok, b.after, "right"),
            "projected_hit_rate": _hit(b.projected),
            "projected_gain_tokens": b.projected.hit_tokens - base.hit_tokens,
            "per_turn": [{"turn": t.number, "cached": base.cached.get(t.request_id, 0),
                          "cached_if_fixed": b.projected.cached.get(t.request_id, 0)} for t in turns],
        })
    report["breakers"] = out_b
    # evictions: who evicted whom, and a bigger pool
    n = trace.config.num_blocks
    bs = trace.config.block_size
    enough = min(MAX_POOL, sum(-(-(len(r.prompt_ids) + len(r.output_ids) + 1) // bs) for r in trace.requests))
    sizes = sorted({s for s in (2 * n, enough) if s > n})
    report["evictions"] = {
        "tokens": reasons["evicted"],
        "by": [{"victim": v, "evictor": e, "tokens": k} for (v, e), k in sorted(evicted.items(), key=lambda kv: -kv[1])],
        "projected": [{"num_blocks": s, "never_evicts": s == enough, "hit_rate": _hit(simulate(trace, num_blocks=s))}
                      for s in sizes]
        if reasons["evicted"] else [],
    }
    report["isolation"] = {
        "tokens": reasons["isolated"], "mode": trace.config.isolation,
        "from": [{"user": u, "from": f, "tokens": k} for (u, f), k in sorted(isolated.items(), key=lambda kv: -kv[1])],
        "projected": {"isolation": "shared", "hit_rate": _hit(simulate(trace, isolation="shared"))}
        if reasons["isolated"] else None,
    }
    clears = reasons["cleared"] + reasons["config"]
    has_clear = any(isinstance(it, Clear) for it in trace.items)
    report["clears"] = {"tokens": clears, "projected": {"hit_rate": _hit(simulate(_no_clears(trace)))}
                        if clears and has_clear else None}
    report["turns"] = [{"turn": t.number, "request_id": t.request_id, "user": t.user, "prompt_tokens": t.prompt_tokens,
                        "cached_tokens": t.cached_tokens,
                        "reasons": (t.miss or {}).get("reasons") or empty_reasons(),
                        "diverged_at": (t.miss or {}).get("diverged_at")} for t in turns]
    return report


def figure(report: dict, plt):
    """A matplotlib figure: missed tokens by reason per turn (stacked over the cached ones), and
    the simulated hit rate now next to each projected fix."""
    turns = report["turns"]
    colours = {"cold": "#9e9e9e", "evicted": "#d62728", "isolated": "#9467bd", "diverged": "#ff7f0e",
               "tail": "#c7c7c7", "cleared": "#8c564b", "config": "#17becf", "collision": "#000000"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [3, 1.5]})
    xs = list(range(len(turns)))
    bottom = [t["cached_tokens"] for t in turns]
    ax.bar(xs, bottom, color="#2ca02c", label="cached")
    for reason in REASONS:
        vals = [t["reasons"].get(reason, 0) for t in turns]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=colours[reason], label=reason)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(xs, [str(t["turn"]) for t in turns], fontsize=7 if len(turns) > 20 else 9)
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens")
    ax.set_title("why each prompt token was computed")
    ax.legend(fontsize=8, ncols=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    labels, vals = ["as recorded"], [report["simulated_hit_rate"] * 100]
    for b in report["breakers"]:
        labels.append(f"breaker at {b['at']} removed")
        vals.append(b["projected_hit_rate"] * 100)
    for p in report["evictions"]["projected"]:
        labels.append(f"pool of {p['num_blocks']:,} blocks" + (" (never evicts)" if p["never_evicts"] else ""))
        vals.append(p["hit_rate"] * 100)
    if report["isolation"]["projected"]:
        labels.append("shared isolation")
        vals.append(report["isolation"]["projected"]["hit_rate"] * 100)
    if report["clears"]["projected"]:
        labels.append("no clears")
        vals.append(report["clears"]["projected"]["hit_rate"] * 100)
    ys = list(range(len(labels)))[::-1]
    bx.barh(ys, vals, color=["#2ca02c"] + ["#1f77b4"] * (len(vals) - 1))
    bx.set_yticks(ys, labels, fontsize=8)
    bx.set_xlim(0, 100)
    bx.set_xlabel("prompt tokens from the cache (%)")
    bx.set_title("if fixed (simulated)")
    for y, v in zip(ys, vals):
        bx.text(min(v + 1, 80), y, f"{v:.0f} %", va="center", fontsize=8)
    fig.suptitle(f"kvplay explain: {report['source']}", fontsize=10)
    fig.tight_layout()
    return fig
