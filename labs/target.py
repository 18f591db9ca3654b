"""The leak and determinism labs against a real OpenAI-compatible server (`--target URL`).

The labs' client of a remote server (vLLM, SGLang, `kvplay serve`): every request is a streamed
``POST /v1/completions`` sent through ``serve.client.HttpPeer`` (one HTTP client per API key),
by token ids (leak: exact block alignment) or text (determinism). TTFT is measured by the client,
from sending the request to the first streamed chunk with a choice; the server's own count of
reused prompt tokens comes from ``usage.prompt_tokens_details.cached_tokens`` when it reports it.

Two clients play the two users: the attacker/measured user (``--api-key``) and the victim/
cache-warming user (``--other-api-key``; without it both send the server's default identity, and
the body's ``user`` names them, which only a keyless playground such as vLLM or a keyless
``kvplay serve`` reads). With ``--cache-salt-per-user`` the leak lab also runs with each client
sending its own random ``cache_salt`` (vLLM's request field, hashed into the first block): the
harness assigns the salts, standing in for the server's authentication layer, as vLLM's docs
suggest; a server that ignores the field (``kvplay serve``, which salts by API key instead) shows
the same AUC and a non-zero cached count on hit probes, and the verdict says so.

Cold baselines are honest: the leak lab sends a fresh random secret before every probe (a miss
probe can only be cold, a hit probe can only hit the victim's blocks); the determinism lab
empties the server's prefix cache with ``POST /reset_prefix_cache`` (or ``/flush_cache``) where
the server allows it, else starts every prompt with a fresh random marker.
"""
from __future__ import annotations

import math
import random
import secrets
import statistics
import time
from dataclasses import dataclass, field

from kvplay.engine.errors import EngineError
from kvplay.options import KvplayError, check_output_file
from kvplay.serve.client import HttpPeer

from . import stats
from .common import LabContext, LabResult, Progress, Table, emit, quoted
from .determinism import COMPANIONS, OTHER_QUESTION, PROMPTS, SYSTEM
from .leak import SAMPLES, Attacker, blocks_word, overall, plot, row_phrase

VICTIM, ATTACKER = "victim", "mallory"
VOCAB_TRIES = (32000, 4096, 256, 100)  # the largest id range the server accepts is the probe's
FIRST_ID = 20  # skip the low ids, where tokenizers keep their special tokens
SALT_MODES = ("none", "per-user")


class Client:
    """One user of the target: its HTTP client (its API key), its body `user` and its salt."""

    def __init__(self, peer: HttpPeer, user: str, salt: str | None = None):
        self.peer, self.user, self.salt = peer, user, salt
        self.last: dict = {}

    def complete(self, prompt, max_tokens: int, **extra) -> dict:
        body = {"user": self.user, **extra}
        if self.salt is not None:
            body["cache_salt"] = self.salt
        t0 = time.perf_counter()
        got = self.peer.complete(prompt, max_tokens, body)
        got["ttft_ms"] = (got["first"] - t0) * 1000
        self.last = got
        return got

    def ttft_ms(self, prompt_ids: list[int]) -> float:
        return self.complete(prompt_ids, 1)["ttft_ms"]


class RemoteAttacker(Attacker):
    """The leak lab's attacker over HTTP: its own client, its own clock (calibration is leak's)."""

    def __init__(self, client: Client):
        self.client = client

    def ttft_ms(self, prompt_ids: list[int]) -> float:
        return self.client.ttft_ms(prompt_ids)


class Target:
    """A remote OpenAI-compatible server and the two clients the labs use."""

    def __init__(self, url: str, api_key: str | None = None, other_api_key: str | None = None,
                 model: str | None = None):
        self.url = url
        self.main = HttpPeer(url, model=model, api_key=api_key)
        self.other = None
        self._other_key = other_api_key
        self.cold_by = ""

    def connect(self) -> "Target":
        self.main.connect()
        self.other = HttpPeer(self.url, model=self.main.model, api_key=self._other_key or self.main_key())
        if self._other_key:
            self.other.connect()
        return self

    def main_key(self) -> str | None:
        auth = self.main.client.headers.get("authorization")
        return auth.split(" ", 1)[1] if auth else None

    @property
    def label(self) -> str:
        return self.main.label

    def client(self, user: str, other: bool = False, salt: str | None = None) -> Client:
        return Client(self.other if other else self.main, user, salt)

    def reset(self) -> bool:
        return self.main.reset_prefix_cache()

    def close(self) -> None:
        for p in (self.main, self.other):
            if p is not None:
                p.close()

    def vocab_top(self) -> int:
        """The largest of VOCAB_TRIES whose last id the server accepts in a prompt."""
        c = self.client("probe")
        for top in VOCAB_TRIES:
            try:
                c.complete([top - 1], 1)
                return top
            except EngineError as exc:
                if "HTTP 400" not in str(exc):
                    raise
        raise EngineError(f"{self.url}: the server refused every token-id prompt (ids up to {VOCAB_TRIES[-1]})")

    def block_size(self, rng: random.Random, top: int) -> int | None:
        """The server's block size, from its cached_tokens: a prompt P, then P's first m tokens
        plus a fresh tail for m = 8, 16, 32, …: the first m that hits is one block. None when the
        server reports no cached tokens."""
        c = self.client("probe")
        rand = lambda n: [rng.randrange(FIRST_ID, top) for _ in range(n)]  # noqa: E731
        base = rand(257)
        if c.complete(base, 1)["cached_tokens"] is None:
            return None
        for m in (8, 16, 32, 64, 128, 256):
            cached = c.complete(base[:m] + rand(4), 1)["cached_tokens"] or 0
            if cached:
                return cached
        return None


def open_target(args) -> Target:
    return Target(args.target, args.api_key, args.other_api_key, args.target_model).connect()


# --- leak ---------------------------------------------------------------------------------------
@dataclass
class TargetLeakParams:
    blocks: list[int] = field(default_factory=lambda: [1, 4])
    samples: int = SAMPLES  # AUC interval about ± 0.08
    tail: int = 4
    calibration: int = 5
    salts: list[str] = field(default_factory=lambda: ["none"])
    block_size: int | None = None
    seed: int = 0


def _measure_leak(target: Target, ctx: LabContext, salt_mode: str, k: int, bs: int, p: TargetLeakParams,
                  rng: random.Random, top: int) -> dict:
    length = k * bs + p.tail
    rand = lambda n: [rng.randrange(FIRST_ID, top) for _ in range(n)]  # noqa: E731
    salted = salt_mode == "per-user"
    victim = target.client(VICTIM, other=True, salt=f"kvplay-{VICTIM}-{secrets.token_hex(8)}" if salted else None)
    attacker_client = target.client(ATTACKER, salt=f"kvplay-{ATTACKER}-{secrets.token_hex(8)}" if salted else None)
    attacker = RemoteAttacker(attacker_client)
    threshold = attacker.calibrate(lambda: rand(length), p.calibration)
    labels = ["hit"] * p.samples + ["miss"] * p.samples
    rng.shuffle(labels)
    hit, miss, hit_cached, correct = [], [], [], 0
    for label in labels:
        secret = rand(length)  # fresh before every probe: nothing an earlier probe wrote can match
        victim.complete(secret, 1)
        if label == "hit":
            probe = secret[:k * bs] + rand(p.tail)
        else:
            probe = rand(length)
            while probe[0] == secret[0]:
                probe[0] = rng.randrange(FIRST_ID, top)
        ms = attacker.ttft_ms(probe)
        if label == "hit":
            hit.append(ms)
            hit_cached.append(attacker_client.last.get("cached_tokens"))  # the harness's check, not the attacker's
        else:
            miss.append(ms)
        correct += (ms < threshold) == (label == "hit")
        ctx.advance()
    reported = [c for c in hit_cached if c is not None]
    return {"salt": salt_mode, "blocks": k, "tokens": k * bs, "hit_ms": hit, "miss_ms": miss,
            "threshold_ms": threshold, "accuracy": correct / len(labels),
            **stats.separation(hit, miss, seed=p.seed), "median_hit_ms": statistics.median(hit),
            "median_miss_ms": statistics.median(miss),
            "hit_cached_tokens": statistics.median(reported) if reported else None,
            # leak.plot draws one line per "isolation"
            "isolation": "shared" if not salted else "cache_salt per user", "mitigation": "none"}


def run_leak(target: Target, params: TargetLeakParams | None = None, ctx: LabContext | None = None) -> LabResult:
    p = params or TargetLeakParams()
    ctx = ctx or LabContext()
    t_start = time.perf_counter()
    rng = random.Random(p.seed)
    top = target.vocab_top()
    bs = p.block_size or target.block_size(rng, top)
    if bs is None:
        raise EngineError(f"{target.url}: its block size could not be read from usage.prompt_tokens_details."
                          "cached_tokens (not reported, or over 256 tokens): give --block-size N")
    target.client("warmup").complete([rng.randrange(FIRST_ID, top) for _ in range(8)], 1)  # first-call costs
    reset = target.reset()  # not needed (fresh secrets), but starts from an empty cache where allowed
    results = []
    for mode in p.salts:
        ctx.phase(f"cache_salt={mode}", 2 * p.samples * len(p.blocks))
        for k in p.blocks:
            results.append(_measure_leak(target, ctx, mode, k, bs, p, rng, top))
    ctx.progress.close()
    rows = [[r["salt"], r["blocks"], r["tokens"], r["median_hit_ms"], r["median_miss_ms"], r["auc"],
             stats.interval(r["auc_lo"], r["auc_hi"]), r["ks_p"], r["accuracy"], r["call"], r["hit_cached_tokens"]]
            for r in results]
    tables = [Table(f"Attacker's client-side TTFT over HTTP, {p.samples} hit + {p.samples} miss probes per row "
                    f"(block size {bs})",
                    ["cache_salt", "shared blocks", "tokens", "median hit ms", "median miss ms", "ROC AUC",
                     "95 % CI", "KS p (hit<miss)", "accuracy", "verdict", "server cached tokens (hit probes, median)"],
                    rows)]
    cfg = {"target": target.url, "server": target.label, "block_size": bs, "vocab_ids": [FIRST_ID, top],
           "reset_before": f"POST {target.main.reset_path}" if reset else None,
           "cold_by": "a fresh random secret before every probe"}
    data = {"params": p.__dict__, "results": results, "mitigations": []}
    return LabResult("leak", _leak_verdict(results, target.label), tables, data, target.label, cfg,
                     time.perf_counter() - t_start)


def _leak_verdict(results: list[dict], label: str) -> str:
    parts = [f"Against {label}:"]
    for mode in dict.fromkeys(r["salt"] for r in results):
        rs = [r for r in results if r["salt"] == mode]
        top = rs[-1]
        what = "no cache_salt" if mode == "none" else "a cache_salt per user"
        parts.append(f"With {what} ({top['n_hit']} hit + {top['n_miss']} miss probes per row) — "
                     f"{overall([r['call'] for r in rs]).upper()}: " + ", ".join(row_phrase(r) for r in rs)
                     + f"{blocks_word(rs)} (95 % intervals); accuracy {top['accuracy']:.0%} and "
                       f"KS p={top['ks_p']:.1g} at {top['blocks']}{blocks_word([top])} "
                       f"(median hit {top['median_hit_ms']:.0f} vs miss {top['median_miss_ms']:.0f} ms).")
        cached = [r["hit_cached_tokens"] for r in rs if r["hit_cached_tokens"] is not None]
        if mode == "none" and cached and max(cached) == 0 and "leak" in [r["call"] for r in rs]:
            parts.append("The server reused none of the victim's blocks for hit probes (cached tokens 0), so this "
                         "separation is not its prefix cache: chance or drift between the probes (one 95 % interval "
                         "in twenty misses 0.5); run again with another --seed before calling it a channel.")
        if mode == "per-user":
            if cached and max(cached) > 0:
                parts.append("The server still reused the victim's blocks for hit probes (cached tokens "
                             + ", ".join(f"{c:.0f}" for c in cached) + "): it ignores cache_salt.")
            elif cached:
                parts.append("The server reused none of the victim's blocks for hit probes: the salts isolated them.")
    return " ".join(parts)


# --- determinism --------------------------------------------------------------------------------
@dataclass
class TargetDeterminismParams:
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS) + list(COMPANIONS))
    max_tokens: int = 16
    system: str = SYSTEM
    seed: int = 0


def prompt_text(system: str, question: str, marker: str = "") -> str:
    return f"{marker}{system}\n\nQuestion: {question}\nAnswer:"


def _tokens(got: dict) -> tuple[list[int] | None, list[float]]:
    """Output token ids and top-2 logprob gaps from the streamed logprobs (vLLM with
    return_tokens_as_token_ids); (None, []) when the server sends none."""
    ids, gaps = [], []
    for lp in got.get("logprobs") or []:
        for tok in lp.get("tokens") or []:
            if not (isinstance(tok, str) and tok.startswith("token_id:")):
                return None, []
            ids.append(int(tok.split(":", 1)[1]))
        for top in lp.get("top_logprobs") or []:
            vals = sorted((v for v in (top or {}).values() if v is not None and math.isfinite(v)), reverse=True)
            gaps.append(vals[0] - vals[1] if len(vals) >= 2 else None)
    return (ids or None), gaps


def compare_outputs(ref: dict, other: dict) -> dict:
    """Greedy outputs compared by token ids when both have them, else by text."""
    a_ids, a_gaps = _tokens(ref)
    b_ids, _ = _tokens(other)
    if a_ids is not None and b_ids is not None:
        by, a, b = "token ids", a_ids, b_ids
    else:
        by, a, b = "text", ref["text"], other["text"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    gaps = [g for g in a_gaps if g is not None]
    gap_there = a_gaps[first] if by == "token ids" and first is not None and first < len(a_gaps) else None
    return {"by": by, "agree": first is None, "first_divergence": first, "top2_gap_cold": gap_there,
            "min_top2_gap_cold": min(gaps) if gaps else None}


def run_determinism(target: Target, params: TargetDeterminismParams | None = None,
                    ctx: LabContext | None = None) -> LabResult:
    p = params or TargetDeterminismParams()
    ctx = ctx or LabContext()
    t_start = time.perf_counter()
    rng = random.Random(p.seed)
    alice, bob = target.client("alice", other=True), target.client("bob")  # alice warms, bob is measured
    extra = {"logprobs": 2, "return_tokens_as_token_ids": True, "ignore_eos": False}
    bob.complete(prompt_text(p.system, OTHER_QUESTION, "warm-up "), 2)  # first-call costs, not compared
    can_reset = target.reset()
    target.cold_by = (f"POST {target.main.reset_path} before every cold run" if can_reset
                      else "a fresh random marker at the start of every prompt (the server has no reset)")
    per_prompt = 4 if can_reset else 2
    ctx.phase("prompts", per_prompt * len(p.prompts))
    runs = []

    def go(client, text):
        got = client.complete(text, p.max_tokens, **extra)
        ctx.advance()
        return got

    for i, q in enumerate(p.prompts):
        marker = "" if can_reset else f"[{rng.getrandbits(64):016x}] "
        text = prompt_text(p.system, q, marker)
        variants = []
        if can_reset:
            target.reset()
            ref = go(bob, text)  # cold: bob alone on an empty cache
            target.reset()
            variants.append(("cold again", go(bob, text)))
            target.reset()
            alice.complete(text, p.max_tokens, **extra)  # alice writes the prompt's blocks
            variants.append(("warm: same prompt (alice)", go(bob, text)))
            target.reset()
            alice.complete(prompt_text(p.system, OTHER_QUESTION), p.max_tokens, **extra)
            variants.append(("warm: system prompt (alice)", go(bob, text)))
        else:  # no reset: the fresh marker makes alice's run cold, and bob's reuses alice's blocks
            ref = go(alice, text)
            variants.append(("warm: same prompt (alice)", go(bob, text)))
        runs.append({"prompt": i + 1, "question": q, "variant": "cold (reference)", "text": ref["text"],
                     "cached_tokens": ref["cached_tokens"], "prompt_tokens": ref["prompt_tokens"], "agree": True,
                     **{k: v for k, v in compare_outputs(ref, ref).items() if k != "agree"}})
        for name, got in variants:
            runs.append({"prompt": i + 1, "question": q, "variant": name, "text": got["text"],
                         "cached_tokens": got["cached_tokens"], "prompt_tokens": got["prompt_tokens"],
                         **compare_outputs(ref, got)})
    ctx.progress.close()
    summary = _det_summary(runs)
    rows = [[r["prompt"], r["variant"], f"{r['cached_tokens'] if r['cached_tokens'] is not None else '?'}"
             f"/{r['prompt_tokens']}", r["by"], r["agree"], r["first_divergence"], r["top2_gap_cold"],
             r["min_top2_gap_cold"]] for r in runs]
    tables = [Table("Greedy output vs the cold run (same prompt, same measured user)",
                    ["prompt", "run", "cached/prompt", "compared by", "agrees", "diverges at", "top-2 gap there",
                     "min top-2 gap (cold)"], rows),
              Table("Per kind", ["run", "agree / N", "warm (cached > 0)"],
                    [[k, f"{v['agree']}/{v['n']}", f"{v['warm']}/{v['n']}"] for k, v in summary["kinds"].items()])]
    diverged = [r for r in runs if not r["agree"]]
    if diverged:
        cold = {r["prompt"]: r["text"] for r in runs if r["variant"].startswith("cold (")}
        tables.append(Table("Diverged texts", ["prompt", "run", "text (cold text below)"],
                            [[r["prompt"], r["variant"], f"{quoted(r['text'])}\ncold: {quoted(cold[r['prompt']])}"]
                             for r in diverged]))
    cfg = {"target": target.url, "server": target.label, "cold_by": target.cold_by, "max_tokens": p.max_tokens}
    return LabResult("determinism", _det_verdict(summary, target), tables,
                     {"params": p.__dict__, "runs": runs, "summary": summary}, target.label, cfg,
                     time.perf_counter() - t_start)


def _det_summary(runs: list[dict]) -> dict:
    kinds: dict = {}
    for r in runs:
        if r["variant"].startswith("cold ("):
            continue
        k = kinds.setdefault(r["variant"], {"n": 0, "agree": 0, "warm": 0})
        k["n"] += 1
        k["agree"] += r["agree"]
        k["warm"] += bool(r["cached_tokens"])
    gaps = [r["min_top2_gap_cold"] for r in runs if r["variant"].startswith("cold (") and r["min_top2_gap_cold"]
            is not None]
    return {"kinds": kinds, "by": sorted({r["by"] for r in runs}), "min_top2_gap_cold": min(gaps) if gaps else None}


def _det_verdict(s: dict, target: Target) -> str:
    parts = [f"Against {target.label} (cold: {target.cold_by}; outputs compared by {' and '.join(s['by'])}):"]
    for name, k in s["kinds"].items():
        parts.append(f"{name}: greedy output equal to cold in {k['agree']}/{k['n']} prompts "
                     f"(warm in {k['warm']}/{k['n']}; changed in {stats.rate(k['n'] - k['agree'], k['n'])}).")
    if s["min_top2_gap_cold"] is not None:
        parts.append(f"Closest near-tie on the cold paths: top-2 logprob gap {s['min_top2_gap_cold']:.2g}.")
    return " ".join(parts)


# --- the CLI --------------------------------------------------------------------------------------
def main(args, mod_params) -> int:
    """`kvplay lab leak|determinism --target URL …` (called by kvplay/commands/lab.py with its parsed params)."""
    if args.lab not in ("leak", "determinism"):
        raise KvplayError(f"--target works with the leak and determinism labs (not {args.lab!r})")
    if args.plot and args.lab != "leak":
        raise KvplayError("--plot with --target: only the leak lab draws a plot")
    check_output_file(args.plot, "--plot", ".png")
    ctx = LabContext(Progress(args.lab))
    target = open_target(args)
    try:
        if args.lab == "leak":
            lp = mod_params
            params = TargetLeakParams(blocks=lp.blocks, samples=lp.samples, tail=lp.tail, calibration=lp.calibration,
                                      salts=["none", "per-user"] if args.cache_salt_per_user else ["none"],
                                      block_size=args.block_size, seed=args.seed)
            result = run_leak(target, params, ctx)
        else:
            dp = mod_params
            params = TargetDeterminismParams(prompts=list(dp.prompts) if args.prompt else
                                             TargetDeterminismParams().prompts,
                                             max_tokens=dp.max_tokens, system=dp.system, seed=args.seed)
            result = run_determinism(target, params, ctx)
    finally:
        target.close()
    emit(result, args.json, args.plot, plot)
    return 0
