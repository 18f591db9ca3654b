"""Lab: does a shared prefix cache change greedy outputs?

For each prompt, in default and in deterministic mode, the reference is a **cold** run (fresh
cache, alone). It is compared with: a second cold run (run-to-run noise), **warm** runs whose
prefix KV was written by another user (same prompt; or only the shared system prompt), and runs
inside **batches** of other users' requests submitted at the same time. Every step's float32
logits are traced; we report the largest |Δlogit| against cold, whether greedy text diverges,
the first divergent position and the top-2 logit gap there.

Against a real server: `--target URL` compares cold (after `/reset_prefix_cache`) and warm greedy
outputs by token ids where the server streams logprobs (labs/target.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvplay.engine.sampling_params import SamplingParams

from . import stats
from .common import LabContext, LabResult, Table, pyplot, quoted

SYSTEM = ("You are a careful assistant for a small library. Answer briefly and precisely, "
          "use plain words, and say so when you do not know something. Never invent facts.")
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 50.",
]
COMPANIONS = [
    "Explain what a hash function is.",
    "Give me a recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Name five animals that live in the Arctic.",
    "What does a compiler do?",
    "Summarise the plot of Hamlet in two sentences.",
]
OTHER_QUESTION = "Recommend a book about birds."


@dataclass
class DeterminismParams:
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    max_tokens: int = 16
    batch_sizes: list[int] = field(default_factory=lambda: [4])
    modes: list[str] = field(default_factory=lambda: ["default", "deterministic"])
    system: str = SYSTEM


def _messages(system: str, question: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def _run(eng, ctx, user, messages, sampling, trace=True):
    h = eng.submit(user, messages, sampling, trace_logits=trace)
    res = h.result(600)
    if res.error:
        raise RuntimeError(f"request failed: {res.error}")
    ctx.record(user, messages, sampling, res)
    return res, (h.request.logits_trace or [])


def compare(ref: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Step-by-step comparison of two greedy logit traces (argmax = the emitted token)."""
    n = min(len(ref), len(other))
    deltas, first = [], None
    bitwise = len(ref) == len(other)
    for i in range(n):
        a, b = ref[i], other[i]
        deltas.append(float((a - b).abs().max()))
        if not torch.equal(a, b):
            bitwise = False
        if int(a.argmax()) != int(b.argmax()):
            first = i
            break
    if first is None and len(ref) != len(other):
        first = n  # one stopped (EOS) where the other did not
    gap_ref = gap_other = None
    if first is not None and first < n:
        gap_ref = _top2_gap(ref[first])
        gap_other = _top2_gap(other[first])
    return {
        "steps": len(deltas), "per_step": deltas, "max_delta": max(deltas) if deltas else 0.0,
        "bitwise": bitwise and first is None, "diverged": first is not None, "first_divergence": first,
        "top2_gap_cold": gap_ref, "top2_gap_this": gap_other,
        "min_top2_gap_cold": min((_top2_gap(t) for t in ref), default=None),
    }


def _top2_gap(logits: torch.Tensor) -> float:
    v = torch.topk(logits.float(), 2).values
    return float(v[0] - v[1])


def _variants(eng, ctx, p: DeterminismParams, question: str, idx: int, sampling):
    """Yield (variant name, result, trace) for one prompt in the engine's current mode."""
    msgs = _messages(p.system, question)
    eng.clear_cache()
    res, tr = _run(eng, ctx, "cold", msgs, sampling)
    yield "cold (reference)", res, tr
    ctx.advance()
    eng.clear_cache()
    res, tr = _run(eng, ctx, "cold", msgs, sampling)
    yield "cold again", res, tr
    ctx.advance()
    eng.clear_cache()
    _run(eng, ctx, "alice", msgs, sampling, trace=False)
    res, tr = _run(eng, ctx, "bob", msgs, sampling)
    yield "warm: same prompt (alice)", res, tr
    ctx.advance()
    if p.system:
        eng.clear_cache()
        _run(eng, ctx, "alice", _messages(p.system, OTHER_QUESTION), sampling, trace=False)
        res, tr = _run(eng, ctx, "bob", msgs, sampling)
        yield "warm: system prompt (alice)", res, tr
        ctx.advance()
    for size in p.batch_sizes:
        if size < 2:
            continue
        eng.clear_cache()
        comp_sampling = SamplingParams(max_tokens=sampling.max_tokens + 8, temperature=0.0, stop_on_eos=False)
        handles = []
        half = (size - 1) // 2  # companions before and after, so our row is not always row 0
        order = [("c", j) for j in range(half)] + [("me", 0)] + [("c", j) for j in range(half, size - 1)]
        for kind, j in order:
            if kind == "me":
                mine = eng.submit("bob", msgs, sampling, trace_logits=True)
            else:
                q = COMPANIONS[(idx + j) % len(COMPANIONS)]
                handles.append((f"user{j + 1}", _messages(p.system, q),
                                eng.submit(f"user{j + 1}", _messages(p.system, q), comp_sampling)))
        res = mine.result(600)
        ctx.record("bob", msgs, sampling, res)
        for user, m, h in handles:
            ctx.record(user, m, comp_sampling, h.result(600))
        yield f"batch of {size}", res, mine.request.logits_trace or []
        ctx.advance()


def run(eng, params: DeterminismParams | None = None, ctx: LabContext | None = None) -> LabResult:
    p = params or DeterminismParams()
    ctx = ctx or LabContext()
    t_start = time.perf_counter()
    sampling = SamplingParams(max_tokens=p.max_tokens, temperature=0.0)
    old = {"isolation": eng.config.isolation, "deterministic": eng.config.deterministic}
    if eng.config.isolation != "shared":
        eng.reconfigure(isolation="shared")  # warm runs need another user's blocks
    _run(eng, ctx, "warmup", _messages(p.system, OTHER_QUESTION), sampling, trace=False)  # not timed
    per_prompt = 4 + (1 if p.system else 0) + sum(1 for s in p.batch_sizes if s >= 2)
    rows, runs, seconds = [], [], {}
    for mode in p.modes:
        eng.reconfigure(deterministic=(mode == "deterministic"))  # clears the cache
        ctx.phase(f"{mode} mode", per_prompt * len(p.prompts))
        t0 = time.perf_counter()
        for i, q in enumerate(p.prompts):
            ref = None
            for name, res, trace in _variants(eng, ctx, p, q, i, sampling):
                if ref is None:
                    ref = (res, trace)
                    cmp = compare(trace, trace)
                else:
                    cmp = compare(ref[1], trace)
                run_row = {"mode": mode, "prompt": i + 1, "question": q, "variant": name,
                           "cached_tokens": res.stats.cached_tokens, "prompt_tokens": res.stats.prompt_tokens,
                           "text": res.text, **cmp}
                runs.append(run_row)
                rows.append([mode, i + 1, name, f"{res.stats.cached_tokens}/{res.stats.prompt_tokens}",
                             cmp["steps"], cmp["max_delta"], cmp["bitwise"], cmp["diverged"],
                             cmp["first_divergence"], cmp["top2_gap_cold"]])
        seconds[mode] = time.perf_counter() - t0
    eng.reconfigure(**old)  # leave the engine as we found it (the app runs labs on its engine)
    ctx.progress.close()
    summary = _summarise(runs, seconds)
    texts = [[r["mode"], r["prompt"], r["variant"], r["text"]] for r in runs if r["diverged"]]
    tables = [Table("Cached / batched vs cold (greedy, float32 logits)",
                    ["mode", "prompt", "run", "cached/prompt", "steps", "max |Δlogit|", "bitwise",
                     "diverges", "at step", "top-2 gap there"], rows),
              Table("Per mode and kind of run (95 % Clopper-Pearson intervals on the rates)",
                    ["mode", "run vs cold", "n", "bitwise equal", "greedy text changed", "max |Δlogit|",
                     "min top-2 gap (cold)", "seconds"],
                    [[m, kind, k["n"], stats.rate(k["bitwise"], k["n"]), stats.rate(k["diverged"], k["n"]),
                      k["max_delta"], s["min_top2_gap_cold"], s["seconds"]]
                     for m, s in summary["modes"].items() for kind, k in s["by_kind"].items() if k["n"]])]
    if texts:
        ref_text = {(r["mode"], r["prompt"]): r["text"] for r in runs if r["variant"].startswith("cold (")}
        tables.append(Table("Diverged texts", ["mode", "prompt", "run", "text (cold text below)"],
                            [t[:3] + [f"{quoted(t[3])}\ncold: {quoted(ref_text[(t[0], t[1])])}"] for t in texts]))
    return LabResult("determinism", _verdict(summary), tables,
                     {"params": p.__dict__, "runs": runs, "summary": summary},
                     eng.model_name, eng.config.to_dict(), time.perf_counter() - t_start)


def _summarise(runs: list[dict], seconds: dict) -> dict:
    modes = {}
    for mode, sec in seconds.items():
        rs = [r for r in runs if r["mode"] == mode and not r["variant"].startswith("cold (")]
        by_kind = {}
        for kind in ("cold again", "warm", "batch"):
            ks = [r for r in rs if r["variant"].startswith(kind)]
            n, bitwise, diverged = len(ks), sum(r["bitwise"] for r in ks), sum(r["diverged"] for r in ks)
            by_kind[kind] = {"n": n, "bitwise": bitwise, "diverged": diverged,
                             "bitwise_ci": stats.clopper_pearson(bitwise, n),
                             "diverged_ci": stats.clopper_pearson(diverged, n),
                             "max_delta": max((r["max_delta"] for r in ks), default=0.0)}
        modes[mode] = {"compared": len(rs), "bitwise": sum(r["bitwise"] for r in rs),
                       "diverged": sum(r["diverged"] for r in rs),
                       "diverged_ci": stats.clopper_pearson(sum(r["diverged"] for r in rs), len(rs)),
                       "max_delta": max((r["max_delta"] for r in rs), default=0.0),
                       "seconds": sec, "by_kind": by_kind,
                       "min_top2_gap_cold": min((r["min_top2_gap_cold"] for r in runs if r["mode"] == mode
                                                 and r["min_top2_gap_cold"] is not None), default=None)}
    out = {"modes": modes}
    if "default" in seconds and "deterministic" in seconds and seconds["default"] > 0:
        out["deterministic_time_ratio"] = seconds["deterministic"] / seconds["default"]
    return out


def _verdict(s: dict) -> str:
    """A plain sentence about the claim, per mode, then the measurements behind it."""
    parts = [plain(mode, m) for mode, m in s["modes"].items()]
    for mode, m in s["modes"].items():
        k = m["by_kind"]
        parts.append(
            f"Details, {mode} mode: cached (warm) vs cold bitwise equal in {k['warm']['bitwise']}/{k['warm']['n']} "
            f"runs (max |Δlogit| {k['warm']['max_delta']:.2g}), batched vs alone in "
            f"{k['batch']['bitwise']}/{k['batch']['n']} (max {k['batch']['max_delta']:.2g}), cold vs cold in "
            f"{k['cold again']['bitwise']}/{k['cold again']['n']}; "
            f"greedy text diverged in {m['diverged']}/{m['compared']}"
            + (f" (closest near-tie on the cold paths: top-2 gap {m['min_top2_gap_cold']:.2g})."
               if m["min_top2_gap_cold"] is not None else "."))
    if "deterministic_time_ratio" in s:
        parts.append(f"Deterministic mode cost {s['deterministic_time_ratio']:.1f}× the wall time of default "
                     f"mode for the same requests.")
    return " ".join(parts)


def plain(mode: str, m: dict) -> str:
    """What one mode's counts say about "a shared cache makes outputs non-deterministic", in words,
    with n and the interval of every rate claimed."""
    warm, batch = m["by_kind"]["warm"], m["by_kind"]["batch"]
    out = [f"In {mode} mode:"]
    if warm["n"]:
        _, hi = warm["diverged_ci"]
        if warm["diverged"]:
            out.append("reusing another user's cached prefix CHANGED the answer in "
                       f"{stats.rate(warm['diverged'], warm['n'])} runs, so the claim holds here.")
        else:
            same = ("bit for bit" if warm["bitwise"] == warm["n"] else
                    f"though the scores differed in their last digits in {warm['n'] - warm['bitwise']} of them "
                    f"(at most {warm['max_delta']:.1g})")
            out.append(f"reusing another user's cached prefix gave the same answer as a cold cache in "
                       f"{warm['n']}/{warm['n']} runs, {same}; so the claim does not hold here — with "
                       f"{warm['n']} runs, a change rate above {100 * hi:.0f} % would very likely have shown "
                       f"(95 % CI 0–{100 * hi:.0f} %"
                       + ("; more prompts narrow it)." if hi > 0.2 else ")."))
    if batch["n"]:
        gap = m.get("min_top2_gap_cold")
        margin = (f", {gap / batch['max_delta']:.0f}× less than the closest call between the two likeliest next "
                  f"tokens on any cold run ({gap:.2g})" if gap and batch["max_delta"] > 0 else "")
        if batch["diverged"]:
            out.append("Sharing a batch with other users changed the answer in "
                       f"{stats.rate(batch['diverged'], batch['n'])} runs.")
        elif batch["bitwise"] == batch["n"]:
            out.append(f"Sharing a batch with other users changed nothing, bit for bit ({batch['n']}/{batch['n']}).")
        else:
            out.append(f"Sharing a batch with other users changed the scores by at most {batch['max_delta']:.1g}"
                       f"{margin}, and no answer ({batch['diverged']}/{batch['n']}).")
    return " ".join(out)


def plot(result: LabResult, path: str) -> None:
    plt = pyplot()
    runs = [r for r in result.data["runs"] if not r["variant"].startswith("cold (")]
    modes = sorted({r["mode"] for r in runs})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for r in (r for r in runs if r["mode"] == mode):
            ys = [max(d, 1e-9) for d in r["per_step"]]
            ax.plot(range(len(ys)), ys, marker=".", alpha=0.7, label=f"p{r['prompt']} {r['variant']}")
        ax.set_yscale("log")
        ax.set_title(f"{mode}: max |Δlogit| vs cold per step (0 drawn at 1e-9)")
        ax.set_xlabel("output step")
        ax.set_ylabel("max |Δlogit|")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
