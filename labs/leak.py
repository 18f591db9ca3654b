"""Lab: can another user tell, from its own time to first token, what is in the shared cache?

A victim user sends a secret prompt (raw tokens, like a completion API). An attacker user sees
only what a client sees: it connects to a ``Server`` layer once (the server authenticates it and
binds its identity in the engine's user registry, so the isolation salt is the server's, never
a name the client picks per request), submits candidate prompts on that connection and measures
the wall time from submit to its first streamed token, in its own code (the ``Attacker`` class
holds its connection, never the engine). A **hit** candidate starts with the victim's first k
blocks, a **miss** candidate with random tokens; both have the same length. The attacker
calibrates a threshold on its own prompts (a fresh one, then the same one again) and guesses
hit when a probe is faster. We report ROC AUC (with a bootstrap 95 % interval) and accuracy
against k, a one-sided KS test of hit vs miss TTFT, under each isolation mode, and under two
server-side mitigations: a random delay before the first token, and padding TTFT up to a constant.
Each row pools several repeats (seeds), each with its own calibration, secrets and shuffled order;
the default probe count makes the AUC interval about ± 0.08, and the verdict says "leak", "no
evidence of a leak" or "inconclusive" only as the interval allows (labs/stats.py). With
``control`` every setting also gets an A/A row: the same procedure with "hit" probes unrelated to
the victim, whose AUC is what the procedure alone (order, load drift) produces.

Against a real server (vLLM, SGLang, `kvplay serve`): `--target URL` runs the same method over
HTTP with two clients, with and without per-user `cache_salt` (labs/target.py).
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from kvplay.engine.sampling_params import SamplingParams

from . import stats
from .common import LabContext, LabResult, Table, pyplot, token_messages, token_pool

PROBE = SamplingParams(max_tokens=1, temperature=0.0, stop_on_eos=False)
VICTIM, ATTACKER = "victim", "mallory"


REPEATS = 3  # independent runs (seeds seed, seed+1, …) pooled into every row
SAMPLES = -(-stats.samples_for_auc(stats.LEAK_HALFWIDTH) // REPEATS) * REPEATS  # 102: AUC ± 0.08 at 95 %
QUICK_SAMPLES = 15  # `--quick`: a fast look, interval about ± 0.2


@dataclass
class LeakParams:
    blocks: list[int] = field(default_factory=lambda: [1, 4, 8])  # prefix blocks shared with the secret
    samples: int = SAMPLES  # hit probes and miss probes per row, over all repeats
    repeats: int = REPEATS  # seeds seed .. seed+repeats-1, each with its own calibration, secrets and order
    tail: int = 4  # tokens after the guessed prefix in every probe
    calibration: int = 5  # attacker's own (miss, hit) pairs per setting and repeat
    isolations: list[str] = field(default_factory=lambda: ["shared", "user"])
    mitigations: list[str] = field(default_factory=lambda: ["delay", "pad"])
    delay_ms: float | None = None  # uniform(0, delay_ms); None = 3x the measured gap
    pad_ms: float | None = None  # pad TTFT to this; None = 2x the unmitigated median miss
    control: bool = False  # also a row per setting whose "hit" probes are unrelated to the victim (A/A)
    seed: int = 0


class Server:
    """The serving layer between clients and the engine; can hide the cache's timing.

    A client connects once as a user (the server authenticates it, as an API key would) and the
    server binds that identity in the engine's user registry at that moment; every request on the
    connection is that user's. A client never names itself per request."""

    def __init__(self, engine, ctx: LabContext, mitigation: str = "none", delay_ms: float = 0.0,
                 pad_ms: float = 0.0, seed: int = 0):
        self._engine = engine
        self._ctx = ctx
        self.mitigation = mitigation
        self.delay_ms = delay_ms
        self.pad_ms = pad_ms
        self._rng = random.Random(seed)

    def connect(self, user: str, group: str | None = None) -> "Connection":
        """Authenticate a client as `user` and bind its identity (and group) in the engine."""
        self._engine.register_user(user, group)
        return Connection(self, user)

    def _complete(self, user: str, prompt_ids: list[int]):
        t0 = time.perf_counter()
        h = self._engine.submit(user, prompt_ids=prompt_ids, sampling=PROBE)
        first = True
        for delta in h:
            if first:
                self._hold(t0)
                first = False
            yield delta.text
        res = h.result(600)
        self._ctx.record(user, token_messages(self._engine.tokenizer, prompt_ids), PROBE, res)

    def _hold(self, t0: float) -> None:
        if self.mitigation == "delay":
            time.sleep(self._rng.uniform(0.0, self.delay_ms) / 1000)
        elif self.mitigation == "pad":
            left = self.pad_ms / 1000 - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)


class Connection:
    """One client's authenticated connection: requests on it run as the user bound at connect."""

    def __init__(self, server: Server, user: str):
        self._server = server
        self._user = user

    def complete(self, prompt_ids: list[int]):
        """Stream the completion's text pieces for `prompt_ids`."""
        return self._server._complete(self._user, prompt_ids)


class Attacker:
    """Client-side only: its own connection, its own clock and its own prompts."""

    def __init__(self, connection: Connection):
        self.connection = connection

    def ttft_ms(self, prompt_ids: list[int]) -> float:
        t0 = time.perf_counter()
        stream = self.connection.complete(prompt_ids)
        next(stream, None)
        ms = (time.perf_counter() - t0) * 1000
        for _ in stream:
            pass
        return ms

    def calibrate(self, make_prompt, n: int) -> float:
        """Threshold between its own cold and repeated prompts (midpoint of the medians)."""
        cold, warm = [], []
        for _ in range(n):
            p = make_prompt()
            cold.append(self.ttft_ms(p))
            warm.append(self.ttft_ms(p))
        return (statistics.median(cold) + statistics.median(warm)) / 2


def _split(total: int, parts: int) -> list[int]:
    """`total` probes per class over `parts` repeats, as evenly as possible (none empty)."""
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def _measure_once(eng, ctx, server: Server, k: int, p: LeakParams, rng: random.Random, vocab: list[int],
                  n: int, control: bool) -> dict:
    """One repeat of one setting: a fresh cache, the attacker's own calibration, then n hit and n
    miss probes in a shuffled order, each after a fresh victim secret. In a control run the "hit"
    probes are random like the misses (the victim's content is in none): the procedure's own AUC."""
    bs = eng.config.block_size
    length = k * bs + p.tail
    rand = lambda n: [rng.choice(vocab) for _ in range(n)]  # noqa: E731
    eng.clear_cache()  # the harness, not the attacker, resets the world between settings
    victim = Server(eng, ctx).connect(VICTIM)
    attacker = Attacker(server.connect(ATTACKER))
    threshold = attacker.calibrate(lambda: rand(length), p.calibration)
    labels = ["hit"] * n + ["miss"] * n
    rng.shuffle(labels)
    hit, miss, correct = [], [], 0
    for label in labels:
        # A fresh secret before every probe: a hit probe can only hit the victim's blocks,
        # never blocks the attacker wrote itself with an earlier probe.
        secret = rand(length)
        for _ in victim.complete(secret):
            pass
        if label == "hit" and not control:
            probe = secret[:k * bs] + rand(p.tail)
        else:
            probe = rand(length)
            while probe[0] == secret[0]:
                probe[0] = rng.choice(vocab)
        ms = attacker.ttft_ms(probe)
        (hit if label == "hit" else miss).append(ms)
        correct += (ms < threshold) == (label == "hit")
        ctx.advance()
    return {"hit_ms": hit, "miss_ms": miss, "threshold_ms": threshold, "correct": correct}


def _measure(eng, ctx, server: Server, k: int, p: LeakParams, vocab: list[int], setting: str,
             control: bool = False) -> dict:
    """One row: the repeats' probes pooled; AUC with its bootstrap interval, KS, and per-seed AUCs."""
    hit, miss, correct, per_seed = [], [], 0, []
    for i, n in enumerate(_split(p.samples, p.repeats)):
        seed = p.seed + i
        # every (seed, setting) draws its own secrets and order: rows are independent measurements
        rng = random.Random(f"leak:{seed}:{setting}:{k}:{'control' if control else 'content'}")
        once = _measure_once(eng, ctx, server, k, p, rng, vocab, n, control)
        hit += once["hit_ms"]
        miss += once["miss_ms"]
        correct += once["correct"]
        per_seed.append({"seed": seed, "n": n, "threshold_ms": once["threshold_ms"],
                         "auc": stats.auc(once["miss_ms"], once["hit_ms"])})
    sep = stats.separation(hit, miss, seed=p.seed)
    return {"blocks": k, "tokens": k * eng.config.block_size, "probes": "control" if control else "content",
            "hit_ms": hit, "miss_ms": miss, "accuracy": correct / (len(hit) + len(miss)), **sep,
            "per_seed": per_seed, "median_hit_ms": statistics.median(hit), "median_miss_ms": statistics.median(miss),
            "mean_ms": statistics.fmean(hit + miss)}


def run(eng, params: LeakParams | None = None, ctx: LabContext | None = None) -> LabResult:
    p = params or LeakParams()
    ctx = ctx or LabContext()
    t_start = time.perf_counter()
    rng = random.Random(p.seed)
    vocab = token_pool(eng.tokenizer)
    old_isolation, old_across = eng.config.isolation, eng.miss_across_keys
    # the Server layer is a keyed server's: misses explained from the sender's own keys only, as
    # `kvplay serve --api-keys` does (the lookup across keys is a time channel of its own)
    eng.set_miss_across_keys(False)
    results = []
    kmax = max(p.blocks)
    for _ in Server(eng, LabContext()).connect("warmup").complete([rng.choice(vocab) for _ in range(8)]):
        pass  # warm up the model before timing anything
    kinds = [False, True] if p.control else [False]
    for iso in p.isolations:
        eng.reconfigure(isolation=iso)
        ctx.phase(f"isolation={iso}", 2 * p.samples * len(p.blocks) * len(kinds))
        for k in p.blocks:
            for control in kinds:
                r = _measure(eng, ctx, Server(eng, ctx, seed=p.seed), k, p, vocab, iso, control)
                results.append({"isolation": iso, "mitigation": "none", **r})
    mitigated = []
    base = next((r for r in results if r["isolation"] == "shared" and r["blocks"] == kmax
                 and r["probes"] == "content"), None)
    if p.mitigations and base is not None:
        eng.reconfigure(isolation="shared")
        gap = max(base["median_miss_ms"] - base["median_hit_ms"], 1.0)
        delay = p.delay_ms if p.delay_ms is not None else 3 * gap
        pad = p.pad_ms if p.pad_ms is not None else 2 * base["median_miss_ms"]
        for m in p.mitigations:
            ctx.phase(f"mitigation={m}", 2 * p.samples)
            server = Server(eng, ctx, mitigation=m, delay_ms=delay, pad_ms=pad, seed=p.seed + 1)
            r = _measure(eng, ctx, server, kmax, p, vocab, f"shared+{m}")
            r.update(mitigation=m, isolation="shared", delay_ms=delay if m == "delay" else None,
                     pad_ms=pad if m == "pad" else None, extra_ms=r["mean_ms"] - base["mean_ms"])
            mitigated.append(r)
    eng.reconfigure(isolation=old_isolation)
    eng.set_miss_across_keys(old_across)
    ctx.progress.close()
    seeds = _seeds_text(p)
    rows = [[r["isolation"], r["probes"], r["blocks"], r["tokens"], r["median_hit_ms"], r["median_miss_ms"], r["auc"],
             stats.interval(r["auc_lo"], r["auc_hi"]), r["ks_p"], r["accuracy"], r["call"]] for r in results]
    tables = [Table(f"Attacker's client-side TTFT, {p.samples} hit + {p.samples} miss probes per row ({seeds})",
                    ["isolation", "probes", "shared blocks", "tokens", "median hit ms", "median miss ms", "ROC AUC",
                     "95 % CI", "KS p (hit<miss)", "accuracy", "verdict"], rows)]
    if mitigated:
        tables.append(Table(f"Mitigations (shared isolation, {kmax} blocks)",
                            ["mitigation", "setting", "ROC AUC", "95 % CI", "KS p", "verdict", "mean TTFT ms",
                             "cost: extra mean ms"],
                            [["none", "", base["auc"], stats.interval(base["auc_lo"], base["auc_hi"]), base["ks_p"],
                              base["call"], base["mean_ms"], 0.0]] +
                            [[m["mitigation"], f"uniform 0–{m['delay_ms']:.0f} ms" if m["delay_ms"] is not None
                              else f"pad to {m['pad_ms']:.0f} ms", m["auc"], stats.interval(m["auc_lo"], m["auc_hi"]),
                              m["ks_p"], m["call"], m["mean_ms"], m["extra_ms"]] for m in mitigated]))
    data = {"params": p.__dict__, "halfwidth_target": stats.LEAK_HALFWIDTH,
            "expected_halfwidth": stats.auc_halfwidth(p.samples, p.samples), "results": results,
            "mitigations": mitigated}
    return LabResult("leak", _verdict(results, mitigated, p), tables, data, eng.model_name,
                     eng.config.to_dict(), time.perf_counter() - t_start)


def _seeds_text(p: LeakParams) -> str:
    n = len(_split(p.samples, p.repeats))
    return f"seed {p.seed}" if n == 1 else f"seeds {p.seed}–{p.seed + n - 1} pooled"


def row_phrase(r: dict) -> str:
    """"AUC 0.52 [0.44, 0.60] at 4": a row's AUC with its interval, for a verdict sentence."""
    return f"AUC {r['auc']:.2f} {stats.interval(r['auc_lo'], r['auc_hi'])} at {r['blocks']}"


def blocks_word(rows: list[dict]) -> str:
    """" block" after a list of rows ending with 1 block, else " blocks"."""
    return " block" if rows and rows[-1]["blocks"] == 1 else " blocks"


def overall(calls: list[str]) -> str:
    """The words for several rows: a leak if any row shows one, no evidence only if every row says so."""
    if "leak" in calls:
        return "leak"
    if calls and all(c == "no evidence of a leak" for c in calls):
        return "no evidence of a leak"
    return "inconclusive"


def _verdict(results: list[dict], mitigated: list[dict], p: LeakParams) -> str:
    n = results[0]["n_hit"] if results else p.samples
    parts = [f"With {n} hit and {n} miss probes per row ({_seeds_text(p)}), 95 % intervals:"]
    for iso in dict.fromkeys(r["isolation"] for r in results):
        rs = [r for r in results if r["isolation"] == iso and r["probes"] == "content"]
        word = overall([r["call"] for r in rs])
        top = rs[-1]
        parts.append(f"{iso} isolation — {word.upper()}: " + ", ".join(row_phrase(r) for r in rs)
                     + blocks_word(rs) + f"; KS p={top['ks_p']:.1g} and median hit {top['median_hit_ms']:.0f} vs miss "
                     f"{top['median_miss_ms']:.0f} ms at {top['blocks']}{blocks_word([top])}.")
        controls = [r for r in results if r["isolation"] == iso and r["probes"] == "control"]
        if controls:
            parts.append(_control_sentence(iso, rs, controls))
    for m in mitigated:
        what = (f"random delay 0–{m['delay_ms']:.0f} ms" if m["mitigation"] == "delay"
                else f"padding TTFT to {m['pad_ms']:.0f} ms")
        parts.append(f"{what}: {m['call']}, AUC {m['auc']:.2f} {stats.interval(m['auc_lo'], m['auc_hi'])}, "
                     f"KS p={m['ks_p']:.1g}, costing {m['extra_ms']:+.0f} ms mean TTFT.")
    wide = max((r["auc_hi"] - r["auc_lo"]) / 2 for r in results + mitigated) if results else 0.0
    if wide > stats.LEAK_HALFWIDTH + 0.02:
        parts.append(f"The widest interval is ±{wide:.2f}, wider than ±{stats.LEAK_HALFWIDTH}: "
                     f"use --samples {SAMPLES} (the default without --quick) to decide.")
    return " ".join(parts)


def _control_sentence(iso: str, content: list[dict], controls: list[dict]) -> str:
    """What the content rows and their A/A controls (same procedure, probes unrelated to the victim)
    say together about a signal under `iso` isolation."""
    c_word = overall([r["call"] for r in content])
    a_word = overall([r["call"] for r in controls])
    s = (f"Control (\"hit\" probes unrelated to the victim, same procedure): {a_word}, "
         + ", ".join(row_phrase(r) for r in controls) + blocks_word(controls) + ". ")
    if c_word == "leak" and a_word != "leak":
        return s + "The signal follows the victim's content: a channel, not chance."
    if c_word == "leak":
        return s + "The control separates too: the signal comes from the procedure (order, load drift), not the victim."
    if c_word == "no evidence of a leak" and a_word == "no evidence of a leak":
        return s + "Neither separates: what an attacker sees is chance."
    return s + "Inconclusive: more probes are needed to tell chance from a channel."


def _bar(x: float) -> float:
    return x if x >= 0 else 0.0  # nan (no interval) draws no bar


def plot(result: LabResult, path: str) -> None:
    plt = pyplot()
    res = result.data["results"]
    mit = result.data["mitigations"]
    n = 2 + len(mit)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4))
    for iso in dict.fromkeys(r["isolation"] for r in res):
        for probes in dict.fromkeys(r.get("probes", "content") for r in res):
            rs = [r for r in res if r["isolation"] == iso and r.get("probes", "content") == probes]
            if not rs:
                continue
            lo = [_bar(r["auc"] - r.get("auc_lo", r["auc"])) for r in rs]
            hi = [_bar(r.get("auc_hi", r["auc"]) - r["auc"]) for r in rs]
            axes[0].errorbar([r["blocks"] for r in rs], [r["auc"] for r in rs], yerr=[lo, hi], marker="o",
                             capsize=3, label=iso if probes == "content" else f"{iso}, control")
    axes[0].axhline(0.5, color="grey", ls=":")
    axes[0].set(xscale="log", xlabel="blocks shared with the secret", ylabel="ROC AUC", ylim=(0, 1.05),
                title="attacker AUC (95 % CI) vs shared blocks")
    axes[0].legend()
    rows = [r for r in res if r["isolation"] == "shared" and r.get("probes", "content") == "content"][-1:] + mit
    for ax, r in zip(axes[1:], rows):
        title = r.get("mitigation", "none")
        ax.hist(r["hit_ms"], bins=20, alpha=0.6, label="hit")
        ax.hist(r["miss_ms"], bins=20, alpha=0.6, label="miss")
        ax.set(xlabel="client TTFT ms", title=f"shared, {r['blocks']} blocks, {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
