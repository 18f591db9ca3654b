"""`kvplay audit URL`: is an OpenAI-compatible endpoint's prompt cache shared between API keys?

The procedure is Gu et al.'s ("Auditing Prompt Caching in Language Model APIs", ICML 2025; code:
chenchenygu/auditing-prompt-caching), with its parameters as `AuditParams`:

- a prompt is `prompt_length` random ASCII letters (upper and lower case) joined by spaces, one
  token per letter (checked with the server's ``POST /tokenize``, else its usage counts);
- a **hit procedure**: the victim's key sends a fresh random prompt `victim_sends` times, then
  the attacker's key sends a prompt that keeps its first ``round(prefix_fraction * n)`` letters,
  the next one forced to differ, the rest random;
- a **miss procedure**: the attacker sends a fresh random prompt;
- `probes` hit and `probes` miss procedures in one random order, `max_tokens=1`, `delay` seconds
  after every request;
- levels: ``user`` (the victim's key is the attacker's), ``org`` (two keys of one organisation),
  ``global`` (keys of two organisations): which two keys those are only the caller knows.

Every request is recorded as it ends (sessions/probe_log.py), so an interrupted run keeps its
probes and `resume` continues it with fresh prompts. The statistics and the verdicts are
labs/audit_report.py's; CacheProbe (Fahey, SAGAI '26) adds the second detector reported there,
``usage.prompt_tokens_details.cached_tokens``.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import secrets
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields

from kvplay.engine.errors import EngineError
from kvplay.options import KvplayError, read_text_file
from kvplay.serve.client import HttpError, HttpPeer
from kvplay.sessions.probe_log import ProbeLog

from . import audit_report

LEVELS = ("user", "org", "global")
SWEEPS = ("prefix-fraction", "prompt-length")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
LETTERS = string.ascii_letters
# Gu et al.'s values (Section 4 and their audit.py defaults): `--paper` sets them
PAPER = {"prompt_length": 5000, "prefix_fraction": 0.95, "probes": 250, "delay": 1.0}
# a sweep's values when none are given: Figure 5's shape, from most of the prompt shared to none
SWEEP_VALUES = {"prefix-fraction": [0.95, 0.5, 0.25, 0.1, 0.05, 0.0],
                "prompt-length": [500, 250, 100, 50, 25, 10]}
SWEEP_PROBES = 20  # per value, when --probes is not given: a sweep is many audits
CHECK_LETTERS = (40, 80)  # two prompt lengths whose token counts give tokens per letter
MAX_KEY_FILE = 64 << 10
MAX_KEY = 4096
MAX_STREAM = 1 << 20  # bytes of one probe's stream (max_tokens=1: a few hundred)
MAX_INFO = 8 << 20  # bytes of a /tokenize or /server_info answer read


class AuditError(EngineError):
    """An audit that cannot go on: one line (exit 2); what was recorded stays recorded."""


@dataclass
class AuditParams:
    url: str = ""
    prompt_length: int = 500  # letters (one token each); a CPU server prefills the paper's 5000 for ~10 s
    prefix_fraction: float = 0.95
    victim_sends: int = 1
    probes: int = 50  # hit procedures and miss procedures, each (per level, per sweep value)
    delay: float = 0.1  # seconds after every request, per worker
    alpha: float = 1e-8
    levels: list[str] = field(default_factory=lambda: ["user"])
    endpoint: str = "completions"
    model: str | None = None
    cached_fraction: float = 0.9  # CacheProbe's metadata detector: cached >= this x the shared prefix
    confidence: float = 0.95
    concurrency: int = 1
    max_requests: int = 5000
    sweep: str | None = None
    sweep_values: list[float] = field(default_factory=list)
    block_size: int | None = None
    seed: int = 0
    force: bool = False
    control: bool = False  # also A/A procedures: the victim sends, the attacker's prompt is unrelated
    # written by the run: per-run randomness for the prompts, resumes, the keys' fingerprints
    nonce: str = ""
    attempt: int = 0
    key_prints: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "AuditParams":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def check(self) -> "AuditParams":
        bad = AuditError
        if not 2 <= self.prompt_length <= 200_000:
            raise bad(f"--prompt-length must be from 2 to 200000 letters (got {self.prompt_length})")
        if not 0.0 <= self.prefix_fraction <= 1.0:
            raise bad(f"--prefix-fraction must be from 0 to 1 (got {self.prefix_fraction})")
        if not 1 <= self.victim_sends <= 100:
            raise bad(f"--victim-sends must be from 1 to 100 (got {self.victim_sends}; the paper uses 1, 5 or 25)")
        if not 2 <= self.probes <= 100_000:
            raise bad(f"--probes must be from 2 to 100000 (got {self.probes})")
        if not 0.0 <= self.delay <= 600:
            raise bad(f"--delay must be from 0 to 600 seconds (got {self.delay})")
        if not 0.0 < self.alpha < 1.0:
            raise bad(f"--alpha must be between 0 and 1 (got {self.alpha})")
        if not 0.0 < self.cached_fraction <= 1.0:
            raise bad(f"--cached-fraction must be in (0, 1] (got {self.cached_fraction})")
        if not 0.5 <= self.confidence < 1.0:
            raise bad(f"--confidence must be in [0.5, 1) (got {self.confidence})")
        if not 1 <= self.concurrency <= 64:
            raise bad(f"--concurrency must be from 1 to 64 (got {self.concurrency})")
        if self.block_size is not None and not 1 <= self.block_size <= 1 << 20:
            raise bad(f"--block-size must be a positive number of tokens (got {self.block_size})")
        if not self.levels or any(lv not in LEVELS for lv in self.levels) or len(set(self.levels)) != len(self.levels):
            raise bad(f"--level: one or more of {', '.join(LEVELS)}, each once (got {','.join(self.levels)})")
        if self.endpoint not in ENDPOINTS:
            raise bad(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
        if self.sweep is not None:
            if self.sweep not in SWEEPS:
                raise bad(f"--sweep must be one of {', '.join(SWEEPS)}")
            if len(self.levels) != 1:
                raise bad("--sweep runs at one level: give one --level")
            if not self.sweep_values:
                self.sweep_values = list(SWEEP_VALUES[self.sweep])
            for v in self.sweep_values:
                if self.sweep == "prefix-fraction" and not 0.0 <= v <= 1.0:
                    raise bad(f"--sweep-values: a prefix fraction is from 0 to 1 (got {v:g})")
                if self.sweep == "prompt-length" and (v != int(v) or not 2 <= v <= 200_000):
                    raise bad(f"--sweep-values: a prompt length is a whole number of letters from 2 (got {v:g})")
        elif self.sweep_values:
            raise bad("--sweep-values needs --sweep prefix-fraction|prompt-length")
        return self

    def shape(self, value: float | None) -> tuple[int, float]:
        """(prompt length, prefix fraction) of a procedure at sweep `value` (None: the base)."""
        if value is None:
            return self.prompt_length, self.prefix_fraction
        if self.sweep == "prefix-fraction":
            return self.prompt_length, float(value)
        if self.sweep == "prompt-length":
            return int(value), self.prefix_fraction
        return self.prompt_length, self.prefix_fraction


def shared_letters(n: int, fraction: float) -> int:
    """Letters a hit prompt keeps from the victim's: round(fraction x n), as Gu et al."""
    return min(n, int(math.floor(fraction * n + 0.5)))


# --- the plan and the prompts ------------------------------------------------------------------
def plan(p: AuditParams) -> list[dict]:
    """Every procedure of the run, in its random order (seeded: the same parameters give the same
    order): {"i", "level", "kind", "value"}."""
    values = p.sweep_values if p.sweep else [None]
    kinds = ("hit", "miss", "control") if p.control else ("hit", "miss")
    procs = [{"level": lv, "kind": kind, "value": v} for lv in p.levels for v in values
             for kind in kinds for _ in range(p.probes)]
    random.Random(f"audit-order:{p.seed}").shuffle(procs)
    return [{"i": i, **x} for i, x in enumerate(procs)]


def requests_of(proc: dict, p: AuditParams) -> int:
    return p.victim_sends + 1 if proc["kind"] in ("hit", "control") else 1


def prompts(proc: dict, p: AuditParams) -> tuple[list[str] | None, list[str]]:
    """(victim letters or None, attacker letters) of one procedure. Fresh for every run (the
    run's nonce) and every resume (its attempt): a prompt sent before can never be a miss. A
    control procedure is a hit procedure whose attacker prompt shares nothing with the victim's."""
    n, frac = p.shape(proc["value"])
    rng = random.Random(f"{p.nonce}:{proc['i']}:{p.attempt}")
    rand = lambda k: [rng.choice(LETTERS) for _ in range(k)]  # noqa: E731
    if proc["kind"] == "miss":
        return None, rand(n)
    victim = rand(n)
    if proc["kind"] == "control":  # the hit procedure's steps, the attacker's prompt unrelated
        attacker = rand(n)
        attacker[0] = rng.choice([c for c in LETTERS if c != victim[0]])
        return victim, attacker
    keep = shared_letters(n, frac)
    if keep >= n:
        return victim, list(victim)  # fraction 1: the same prompt
    other = rng.choice([c for c in LETTERS if c != victim[keep]])  # the first suffix letter differs
    return victim, victim[:keep] + [other] + rand(n - keep - 1)


def text_of(letters: list[str]) -> str:
    return " ".join(letters)


# --- keys ----------------------------------------------------------------------------------------
def read_key_file(path: str) -> list[str]:
    """API keys from a file, one per line (blank lines and # comments skipped)."""
    try:
        text = read_text_file(path, MAX_KEY_FILE, "--key-file ")
    except KvplayError as exc:
        raise AuditError(f"{exc} (one key per line)") from None
    keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise AuditError(f"--key-file {path}: no key in it (one key per line, # comments)")
    return keys


def fingerprint(key: str | None) -> str:
    """What a report and the DB keep of a key: 12 hex digits of its SHA-256 (never the key)."""
    return "none" if key is None else hashlib.sha256(key.encode()).hexdigest()[:12]


def assign_keys(keys: list[str], levels: list[str]) -> dict:
    """{"attacker": key, "victims": {level: key}}: the attacker's key is the first; `user` reuses
    it, the other levels take the next keys in the order the levels are named."""
    for k in keys:
        if not k or len(k) > MAX_KEY or any(c.isspace() for c in k):
            raise AuditError(f"an API key must be 1 to {MAX_KEY} characters without spaces")
    others = [lv for lv in levels if lv != "user"]
    if (len(keys) != 1 + len(others)) if others else len(keys) > 1:
        want = 1 + len(others)
        roles = ", ".join(["the attacker's"] + [f"the victim's for --level {lv}" for lv in others])
        raise AuditError(f"--level {','.join(levels)} takes {want} key{'s' if want > 1 else ''} ({roles}); "
                         f"got {len(keys)} (--key K, repeatable, or --key-file F)")
    attacker = keys[0] if keys else None
    victims = {"user": attacker} if "user" in levels else {}
    for lv, k in zip(others, keys[1:]):
        if k == attacker:
            raise AuditError(f"the victim's key for --level {lv} is the attacker's own: that is --level user")
        victims[lv] = k
    if len({victims[lv] for lv in others}) != len(others):
        raise AuditError("--level org and --level global need two different victim keys")
    return {"attacker": attacker, "victims": victims}


# --- the server ------------------------------------------------------------------------------------
class Server:
    """The audited endpoint: one HTTP client per key, its model, how it tokenizes letters and
    (where it says) its block size."""

    def __init__(self, p: AuditParams, keys: dict):
        self.p = p
        self.attacker_key = keys["attacker"]
        self.peers: dict[str | None, HttpPeer] = {}
        self.victim_keys = keys["victims"]
        self.label = ""
        self.model = p.model

    def peer(self, key: str | None) -> HttpPeer:
        return self.peers[key]

    def connect(self) -> "Server":
        """Every key's client, each checked against GET /v1/models (a refused key: one line)."""
        order = [(self.attacker_key, "the attacker's key (key 1)")]
        for i, (lv, k) in enumerate((lv, k) for lv, k in self.victim_keys.items() if lv != "user"):
            order.append((k, f"the victim's key for --level {lv} (key {i + 2})"))
        for key, role in order:
            if key in self.peers:
                continue
            peer = HttpPeer(self.p.url, model=self.model, api_key=key, flag="kvplay audit")
            # no key given: HttpPeer would send $OPENAI_API_KEY; keep the fingerprint honest
            self.peers[key] = peer
            try:
                peer.connect()
            except HttpError as exc:
                if exc.status in (401, 403):
                    raise AuditError(f"{self.p.url}: the server refused {role} (HTTP {exc.status}): "
                                     f"{str(exc).rsplit(': ', 1)[-1]}") from None
                raise
            self.model = peer.model
            self.label = f"{peer.model} at {peer.base} ({peer.server}, POST {ENDPOINTS[self.p.endpoint]})"
        return self

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()

    def body(self, text: str) -> dict:
        b = {"model": self.model, "max_tokens": 1, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}}
        if self.p.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": text}]
        else:
            b["prompt"] = text
        return b

    def send(self, key: str | None, text: str) -> dict:
        got = self.peer(key).stream(ENDPOINTS[self.p.endpoint], self.body(text), max_bytes=MAX_STREAM)
        got["client_ms"] = (got["first"] - got["sent"]) * 1000
        got["total_ms"] = (got["end"] - got["sent"]) * 1000
        ext = got.get("kvplay") or {}
        server = ext.get("ttft_ms") if isinstance(ext.get("ttft_ms"), (int, float)) else got.get("processing_ms")
        got["server_ms"] = float(server) if server is not None else None
        return got

    # --- what the server says about itself -----------------------------------------------------
    def tokenize(self, text: str) -> list[int] | None:
        """The server's token ids for a request with `text` (None: it has no /tokenize)."""
        body = {"model": self.model}
        if self.p.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        status, got = self.peer(self.attacker_key).request_json("POST", "/tokenize", MAX_INFO, json=body)
        tokens = got.get("tokens") if status == 200 and isinstance(got, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    def block_size(self) -> tuple[int | None, str]:
        """(block size, where it came from): --block-size, GET /server_info (kvplay serve's and
        SGLang's page_size, vLLM's cache_config.block_size with VLLM_SERVER_DEV_MODE=1), or None."""
        if self.p.block_size:
            return self.p.block_size, "--block-size"
        status, info = self.peer(self.attacker_key).request_json("GET", "/server_info", MAX_INFO,
                                                                 params={"config_format": "json"})
        if status == 200 and isinstance(info, dict):
            page = info.get("page_size")
            if isinstance(page, int) and page > 0:
                return page, "GET /server_info (page_size)"
            cfg = info.get("vllm_config")
            cache = cfg.get("cache_config") if isinstance(cfg, dict) else None
            bs = cache.get("block_size") if isinstance(cache, dict) else None
            if isinstance(bs, int) and bs > 0:
                return bs, "GET /server_info (vLLM cache_config.block_size)"
        return None, ""


def check_tokenization(server: Server, p: AuditParams, rng: random.Random) -> dict:
    """How the server tokenizes letters joined by spaces: {"per_letter", "head", "by", "note"}
    (tokens per letter with its separator; the tokens before the first letter).
    One token per letter is the procedure's assumption; a whole number k per letter keeps the
    shared prefix exact (a character-level tokenizer: letter, space); anything else (a tokenizer
    that merges letters) does not, and stops the audit unless forced."""
    counts = []
    by = "POST /tokenize"
    for n in CHECK_LETTERS:
        toks = server.tokenize(text_of([rng.choice(LETTERS) for _ in range(n)]))
        if toks is None:
            counts = []
            break
        counts.append(len(toks))
    if not counts:  # no /tokenize: the usage of two requests (they double as the warm-up)
        by = "usage.prompt_tokens"
        for n in CHECK_LETTERS:
            got = server.send(server.attacker_key, text_of([rng.choice(LETTERS) for _ in range(n)]))
            if got["prompt_tokens"] is None:
                return {"per_letter": None, "head": None, "by": None,
                        "note": "cannot check how the server tokenizes letters (no /tokenize, no usage): "
                                "assuming one token per letter"}
            counts.append(got["prompt_tokens"])
    a, b = CHECK_LETTERS
    k = (counts[1] - counts[0]) / (b - a)
    # n letters are k*n tokens less the k-1 of the separator after the last one, plus a fixed
    # number around them (a chat template, a BOS): fixed = count - k*n + (k-1) >= 0
    fixed = counts[0] - k * a + (k - 1)
    linear = k >= 1 and k == int(k) and fixed >= 0
    head = fixed  # tokens before the first letter (all of `fixed` unless measured below)
    if linear and by == "POST /tokenize":
        # a hit pair at the run's length: its full length is linear too (no merges at any length),
        # and the two share exactly head + k*p tokens (the prefix in letters is one in tokens)
        n = p.shape(p.sweep_values[0] if p.sweep else None)[0]
        keep = max(1, min(n - 1, shared_letters(n, p.prefix_fraction)))
        victim = [rng.choice(LETTERS) for _ in range(n)]
        other = victim[:keep] + [next(c for c in LETTERS if c != victim[keep])] + victim[keep + 1:]
        tv, ta = server.tokenize(text_of(victim)), server.tokenize(text_of(other))
        common = next((i for i, (x, y) in enumerate(zip(tv or [], ta or [])) if x != y), None)
        head = None if common is None else common - k * keep
        linear = (tv is not None and len(tv) == fixed + k * n - (k - 1) and head is not None
                  and 0 <= head <= fixed)
    if not linear:
        msg = (f"the server's tokenizer does not give a whole number of tokens per letter ({by}: "
               f"{a} letters -> {counts[0]} tokens, {b} -> {counts[1]}): it merges letters, so a shared prefix "
               "of letters is not a shared prefix of tokens")
        if not p.force:
            raise AuditError(msg + "; --force runs the audit anyway")
        return {"per_letter": None, "head": None, "by": by, "note": msg + " (--force: going on)"}
    k, head = int(k), int(head)
    note = (f"one token per letter ({by})" if k == 1 else
            f"{k} tokens per letter, not one ({by}; a character-level tokenizer): prompts are {k}x longer in "
            "tokens than in letters, and the shared prefix is still exact")
    if head:
        note += f"; {head} tokens before the first letter (a template or BOS, shared by every probe)"
    return {"per_letter": k, "head": head, "by": by, "note": note}


# --- the run ---------------------------------------------------------------------------------------
class Run:
    """One audit: its parameters, its server, its record; `go()` sends what is left of the plan."""

    def __init__(self, p: AuditParams, server: Server, log: ProbeLog, progress=None, on_line=None):
        self.p = p
        self.server = server
        self.log = log
        self.progress = progress
        self.on_line = on_line or (lambda s: None)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.sent = 0

    def _request(self, proc: dict, role: str, key: str | None, letters: list[str], send: int = 0) -> dict:
        text = text_of(letters)
        n, frac = self.p.shape(proc["value"])
        probe = {"procedure": proc["i"], "kind": proc["kind"], "role": role, "level": proc["level"],
                 "value": proc["value"], "attempt": self.p.attempt, "send": send, "letters": n,
                 "shared_letters": shared_letters(n, frac) if proc["kind"] == "hit" else 0,
                 "key": fingerprint(key)}
        started = time.time()
        try:
            got = self.server.send(key, text)
        except EngineError as exc:
            self.log.add(role, text, {**probe, "status": getattr(exc, "status", None)}, started, time.time(),
                         error=str(exc)[:500], sampling={"max_tokens": 1, "temperature": 0})
            raise
        finally:
            with self._lock:
                self.sent += 1
        probe.update(client_ms=got["client_ms"], total_ms=got["total_ms"], server_ms=got["server_ms"])
        self.log.add(role, text, probe, started, time.time(), ttft_ms=got["client_ms"],
                     prompt_tokens=got["prompt_tokens"], cached_tokens=got["cached_tokens"],
                     output_tokens=got["output_tokens"], reply=got["text"], request_id=got["request_id"],
                     sampling={"max_tokens": 1, "temperature": 0})
        if self.progress is not None:
            with self._lock:
                self.progress.advance()
        if self.p.delay:
            self._stop.wait(self.p.delay)
        return got

    def procedure(self, proc: dict) -> None:
        if self._stop.is_set():
            return
        victim, attacker = prompts(proc, self.p)
        if victim is not None:
            key = self.server.victim_keys[proc["level"]]
            for j in range(self.p.victim_sends):
                self._request(proc, "victim", key, victim, j)
        self._request(proc, "attacker", self.server.attacker_key, attacker)

    def go(self, todo: list[dict]) -> None:
        """Send `todo` (procedures), `concurrency` at a time; the first failure stops the rest."""
        if self.p.concurrency == 1:
            for proc in todo:
                self.procedure(proc)
            return
        with ThreadPoolExecutor(self.p.concurrency, thread_name_prefix="kvplay-audit") as pool:
            futures = [pool.submit(self.procedure, proc) for proc in todo]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                self._stop.set()
                for f in futures:
                    f.cancel()
                raise

    def stop(self) -> None:
        self._stop.set()


def failure_line(exc: EngineError, role: str | None = None) -> str:
    """The one line for a request the server refused."""
    status = getattr(exc, "status", None)
    text = str(exc)
    if status in (401, 403):
        return f"the server refused the {role or ''} key (HTTP {status}): {text.rsplit(': ', 1)[-1]}".replace("  ", " ")
    if status == 400 and "max_tokens" in text:
        return f"the server rejects max_tokens=1, which the procedure needs: {text}"
    return text


def new_params(p: AuditParams, keys: dict) -> AuditParams:
    p.nonce = secrets.token_hex(16)
    p.attempt = 0
    p.key_prints = [fingerprint(keys["attacker"])] + [fingerprint(keys["victims"][lv]) for lv in p.levels
                                                       if lv != "user"]
    return p


def params_json(p: AuditParams) -> dict:
    return json.loads(json.dumps(asdict(p)))


# --- start, resume, finish ---------------------------------------------------------------------------
# what --resume may change: pace and analysis, never the procedure
RESUMABLE = ("delay", "concurrency", "max_requests", "force", "alpha", "confidence", "cached_fraction", "block_size")


def remaining(p: AuditParams, log: ProbeLog) -> list[dict]:
    """Procedures of the plan without a recorded, error-free attacker probe."""
    done = {r["probe"].get("procedure") for r in log.probes()
            if r["probe"].get("role") == "attacker" and r["error"] is None and r["ttft_ms"] is not None}
    return [proc for proc in plan(p) if proc["i"] not in done]


def _reopen(db: str | None, resume: str, url: str | None, keys: list[str], overrides: dict | None):
    """(log, params, keys) of a recorded run to continue: its procedure as recorded, the pace and
    statistics flags as given now, the keys checked against its fingerprints (not needed, and
    None, when nothing is left to send)."""
    log = ProbeLog.reopen(db, resume)
    try:
        p = AuditParams.from_dict(log.params)
        for k, v in (overrides or {}).items():
            if k not in RESUMABLE:
                raise AuditError(f"--resume continues the recorded procedure: --{k.replace('_', '-')} "
                                 "cannot change (only the pace, the budget and the statistics can)")
            setattr(p, k, v)
        if url and url.rstrip("/") != p.url.rstrip("/"):
            raise AuditError(f"--resume {log.session_id}: that run audited {p.url}, not {url}")
        p.check()
        if not keys and not remaining(p, log) and log.params.get("found"):
            return log, p, None  # finished: its report again, from the record alone
        ks = assign_keys(keys, p.levels)
        prints = [fingerprint(ks["attacker"])] + [fingerprint(ks["victims"][lv]) for lv in p.levels if lv != "user"]
        if prints != p.key_prints:
            raise AuditError(f"--resume {log.session_id}: these keys are not the run's (key fingerprints "
                             f"{', '.join(prints)} vs {', '.join(p.key_prints)})")
        p.attempt += 1  # fresh prompts for every procedure still to do
        return log, p, ks
    except BaseException:
        log.close(ended=False)
        raise


def execute(p: AuditParams | None, keys: list[str], db: str | None = None, resume: str | None = None,
            overrides: dict | None = None, progress=None, say=None):
    """Run (or continue) an audit; returns its LabResult (labs/audit_report.py). `progress` is a
    labs.common.Progress (or None), `say(line)` prints a note on stderr. Raises AuditError with
    one line on bad input or a refused request, KeyboardInterrupt when interrupted: in both cases
    every request already sent stays recorded and the run can be resumed. Resuming a finished
    run without keys sends nothing: its report is made again from the record."""
    say = say or (lambda s: None)
    t0 = time.perf_counter()
    log = None
    if resume:
        log, p, ks = _reopen(db, resume, p.url if p is not None else None, keys, overrides)
        if ks is None:
            try:
                return _finish(log, p, log.params["found"], t0)
            finally:
                log.close(ended=True)
    else:
        p.check()
        ks = assign_keys(keys, p.levels)
        planned = sum(requests_of(x, p) for x in plan(p)) + 1
        if planned > p.max_requests:
            raise AuditError(f"the plan sends {planned} requests, over --max-requests {p.max_requests}: lower "
                             "--probes or --victim-sends (or fewer --sweep-values), or raise --max-requests")
        new_params(p, ks)
    server = Server(p, ks)
    try:
        server.connect()
        rng = random.Random(f"{p.nonce}:checks:{p.attempt}")
        tok = check_tokenization(server, p, rng)
        say(f"tokenization: {tok['note']}")
        bs, bs_from = server.block_size()
        found = {"tokenization": tok, "block_size": bs, "block_size_from": bs_from,
                 "server": {"url": p.url, "model": server.model, "label": server.label}}
        if log is None:
            users = [("attacker", None)] + [(f"victim:{lv}", lv) for lv in p.levels]
            log = ProbeLog.create(db, server.model or "", f"audit {p.url} ({','.join(p.levels)})",
                                  {**params_json(p), "found": found}, users)
        else:
            log.save_params({**params_json(p), "found": found})
        todo = remaining(p, log)
        left = sum(requests_of(x, p) for x in todo) + 1
        recorded = len(log.probes())
        if recorded + left > p.max_requests:
            raise AuditError(f"{recorded} requests recorded and {left} to go: over --max-requests {p.max_requests}")
        say(f"recording to session {log.session_id} in {log.path} ({len(todo)} of {len(plan(p))} procedures, "
            f"{left} requests to send)")
        run = Run(p, server, log, progress)
        if progress is not None:
            progress.phase(f"{len(todo)} procedures", left)
        warm = [rng.choice(LETTERS) for _ in range(16)]  # first-call costs (a fresh prompt: never a hit)
        try:
            run._request({"i": -1, "kind": "warmup", "level": p.levels[0], "value": None}, "warmup",
                         server.attacker_key, warm)
            run.go(todo)
        except EngineError as exc:
            raise AuditError(f"{failure_line(exc)} ({len(log.probes())} requests recorded in session "
                             f"{log.session_id}; continue with kvplay audit --resume {log.session_id})") from None
        finally:
            if progress is not None:
                progress.close()
        out = _finish(log, p, found, t0)
        log.close(ended=True)
        log = None
        return out
    except KeyboardInterrupt:
        if log is not None:
            say(f"interrupted: {len(log.probes())} requests recorded in session {log.session_id}; continue with "
                f"kvplay audit --resume {log.session_id}")
        raise
    finally:
        server.close()
        if log is not None:
            log.close(ended=False)


def _finish(log: ProbeLog, p: AuditParams, found: dict, t0: float):
    """The report of everything recorded in `log`."""
    rows = log.probes()
    bs, bs_from = found.get("block_size"), found.get("block_size_from")
    if bs is None:
        bs, bs_from = block_size_from_cached(rows)
    info = {"params": params_json(p), "tokenization": found["tokenization"], "block_size": bs,
            "block_size_from": bs_from, "server": found["server"], "session": log.session_id, "requests": len(rows)}
    report = audit_report.analyze(rows, p, found["tokenization"], bs)
    return audit_report.result(report, p, info, time.perf_counter() - t0)


def block_size_from_cached(rows: list[dict]) -> tuple[int | None, str]:
    """The largest block size every positive cached_tokens count is a multiple of (a cache
    hits whole blocks), from at least 3 distinct counts; else (None, "")."""
    counts = {r["cached_tokens"] for r in rows if isinstance(r.get("cached_tokens"), int) and r["cached_tokens"] > 0}
    if len(counts) < 3:
        return None, ""
    g = 0
    for c in counts:
        g = math.gcd(g, c)
    return (g, "the gcd of the cached_tokens counts") if g > 1 else (None, "")
