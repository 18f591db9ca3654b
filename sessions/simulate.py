"""What if: replay a recorded block-level trace through the real scheduler and block pool, with
no model, under other pool sizes, eviction policies and isolation modes, next to Belady's
offline optimum.

How a trace replays. Every request is a recorded turn: its prompt token ids, its output token ids
(and whether it ended on end-of-sequence), its user and group. The engine's own Scheduler and
BlockPool run it; only the model is replaced, by `ReplayRunner`, whose "logits" make the
scheduler's sampler pick the recorded next token. So admission, the longest-prefix lookup,
verify-on-hit, chunked prefill, the block allocated at each decode boundary, preemption,
registration and release are the engine's code, step for step.

When a request enters (concurrency as recorded): at the engine's forward count at which it
was queued live (the recorder stores that clock with every event), and never before the
requests that had finished before it was queued (a user waits for the previous reply; a
script's untimed turn waits for the turn before). When the scheduler runs dry, the clock jumps
to the next arrival. Under the recorded settings this enters every request at the very step it
entered live, so the replay reproduces the live hits token for token. Traces without a step
clock (imported files) replay one request at a time, in order.

Belady's optimum: `Belady` is an EvictionPolicy fed the future access sequence (each request's
reusable prompt block hashes, in arrival order); it evicts the cached block whose next use is
furthest in the future (never used again first), deeper blocks of a chain first on ties.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from kvplay.engine import events as ev_
from kvplay.engine.config import EngineConfig
from kvplay.engine.errors import EngineError
from kvplay.engine.events import EventQueue, RequestFinished, RequestQueued, RequestStarted
from kvplay.engine.eviction import POLICIES, EvictionPolicy, make_policy
from kvplay.engine.kv_manager import KVManager
from kvplay.engine.output import OutputProcessor
from kvplay.engine.pool import BlockPool
from kvplay.engine.prefix import BlockHasher, block_extras
from kvplay.engine.request import Request
from kvplay.engine.sampling import make_generator
from kvplay.engine.sampling_params import SamplingParams
from kvplay.engine.scheduler import Scheduler

from .event_log import batch_row, insert_batch_rows
from .ids import new_ulid
from .recorder import _dumps, versions
from .store import write_txn
from .traces import SIM_POLICIES, Clear, ReadTrace, Trace, TraceRequest

MAX_STEPS = 5_000_000


# --- the model stand-in ------------------------------------------------------------------------
class _SilentTokenizer:
    """The scheduler streams text; a replay has no one to stream to."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


class ReplayRunner:
    """Takes the ModelRunner's place: counts forwards like it and answers each of a decision's
    rows with logits that make the scheduler's own sampler pick the recorded next token (then
    end-of-sequence)."""

    def __init__(self, vocab: int, eos: int):
        self.vocab, self.eos = vocab, eos
        self.forwards = 0
        self.max_positions = 1 << 30
        self.outputs: dict[str, list[int]] = {}

    def _logits(self, req: Request):
        out = self.outputs.get(req.request_id, [])
        n = len(req.output_ids)
        tok = out[n] if n < len(out) else self.eos
        lg = torch.full((self.vocab,), -1e9)
        lg[tok] = 0.0
        return lg

    def forward(self, decision) -> list:
        """One step's "forward" of `decision` (engine/scheduler.SchedulerOutput): per row, the
        logits of its request's next token when the row reaches the end of what is pending."""
        self.forwards += 1
        return [self._logits(req) if req.num_computed + n >= req.num_tokens else None
                for req, n in decision.computed()]


# --- Belady ------------------------------------------------------------------------------------
class FutureUses:
    """The future access sequence: which requests (by arrival position) will look up each block
    hash, and how far along its chain the block sits."""

    def __init__(self, hashes_per_request: list[list[int]]):
        self.uses: dict[int, list[int]] = {}
        self.depth: dict[int, int] = {}
        for i, hashes in enumerate(hashes_per_request):
            for j, h in enumerate(hashes):
                lst = self.uses.setdefault(h, [])
                if not lst or lst[-1] != i:
                    lst.append(i)
                self.depth[h] = j
        self.done: set[int] = set()
        self._ptr: dict[int, int] = {}

    def admitted(self, position: int) -> None:
        self.done.add(position)

    def next_use(self, h: int) -> float:
        lst = self.uses.get(h)
        if not lst:
            return math.inf
        k = self._ptr.get(h, 0)
        while k < len(lst) and lst[k] in self.done:
            k += 1
        self._ptr[h] = k
        return lst[k] if k < len(lst) else math.inf


class Belady(EvictionPolicy):
    """Offline optimum: evict the cached block whose next use is furthest in the future."""
    name = "belady"

    def __init__(self, future: FutureUses) -> None:
        super().__init__()
        self.future = future

    def pick(self, blocks):
        f = self.future
        block_id = max(self._evictable, key=lambda b: (f.next_use(blocks[b].hash), f.depth.get(blocks[b].hash, 0)))
        del self._evictable[block_id]
        return block_id


# --- one run -----------------------------------------------------------------------------------
@dataclass
class SimResult:
    policy: str
    num_blocks: int
    isolation: str
    hit_tokens: int
    query_tokens: int
    evictions: int = 0
    preemptions: int = 0
    cached: dict = field(default_factory=dict)  # request id -> cached tokens at first admission
    events: list = field(default_factory=list)  # (event, forwards) when asked to keep them
    miss: dict = field(default_factory=dict)  # request id -> its miss object (engine/miss.py)
    of_optimum: float | None = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.policy, "num_blocks": self.num_blocks, "isolation": self.isolation,
                "hit_rate": round(self.hit_rate, 6),
                "of_optimum": None if self.of_optimum is None else round(self.of_optimum, 6)}


def _future(trace: Trace, config: EngineConfig, hasher: BlockHasher) -> FutureUses:
    bs = config.block_size
    out = []
    for r in trace.requests:
        n = min((len(r.prompt_ids) - 1) // bs, len(r.prompt_ids) // bs)
        extras = block_extras(config.isolation, r.user, r.group, trace.model_key, n, r.system_tokens, bs)
        out.append(hasher.chain(r.prompt_ids[:n * bs], extras) if n > 0 else [])
    return FutureUses(out)


def simulate(trace: Trace, num_blocks: int | None = None, policy: str | None = None,
             isolation: str | None = None, keep_events: bool = False, attribution: bool = True) -> SimResult:
    """Replay `trace` once (defaults: its recorded settings) and count the prompt tokens reused;
    with `attribution`, also why each request's uncached tokens were computed (the engine's own
    miss attribution, engine/miss.py)."""
    cfg = trace.config
    policy = policy or cfg.eviction
    if policy not in SIM_POLICIES:
        raise EngineError(f"unknown policy {policy!r} ({', '.join(SIM_POLICIES)})")
    config = replace(cfg, num_blocks=num_blocks or cfg.num_blocks, isolation=isolation or cfg.isolation,
                     eviction=policy if policy in POLICIES else "lru").validate()
    hasher = BlockHasher(config.hash, config.block_size, config.hash_seed)
    requests = trace.requests
    position = {r.request_id: i for i, r in enumerate(requests)}
    future = _future(trace, config, hasher) if policy == "belady" else None
    evict = Belady(future) if future is not None else make_policy(policy)
    vocab = 2 + max((t for r in requests for t in r.output_ids), default=0)  # only outputs go through logits
    runner = ReplayRunner(vocab, eos=vocab - 1)
    finished: set[str] = set()
    events: list = []
    seq = [0]
    now = [0.0]  # the wall clock of the latest arrival (imported traces keep their timestamps)

    class Events(EventQueue):
        """The engine's event queue, read as events are queued: Belady's future learns at once
        which request was admitted (an eviction later in the same step depends on it)."""

        def put(self, ev) -> None:
            seq[0] += 1
            ev.seq = seq[0]
            ev.ts = now[0] + seq[0] * 1e-6
            if isinstance(ev, RequestStarted) and future is not None and ev.request_id in position:
                future.admitted(position[ev.request_id])
            elif isinstance(ev, RequestFinished):
                finished.add(ev.request_id)
            if keep_events:
                events.append((ev, runner.forwards))

    queue = Events()
    emit = queue.put
    tokenizer = _SilentTokenizer()
    pool = BlockPool(config.num_blocks, config.block_size, evict, events=queue, hex_fn=hasher.fn.hex)
    kv = KVManager(config, pool, hasher, trace.model_key, emit, decode=tokenizer.decode)
    if not attribution:
        kv.set_attribution(False)
    sched = Scheduler(config, kv, OutputProcessor(tokenizer, {runner.eos}, runner.max_positions, emit), emit)
    reqs = {}
    for i, r in enumerate(requests):
        runner.outputs[r.request_id] = list(r.output_ids)

    def ready(item) -> bool:
        if item.clock is None:  # one at a time
            return not sched.has_work()
        return runner.forwards >= item.clock and item.after <= finished

    def enter(item) -> None:
        if getattr(item, "ts", None) is not None:
            now[0] = max(now[0], item.ts)
        if isinstance(item, Clear):
            pool.clear(item.reason)
            return
        max_tokens = max(1, len(item.output_ids) + (1 if item.stop else 0))
        req = Request(item.request_id, item.user, item.group, list(item.prompt_ids),
                      SamplingParams(temperature=0.0, max_tokens=max_tokens), item.system_tokens, None,
                      make_generator(0))
        req.arrival = float(len(reqs))
        reqs[item.request_id] = req
        emit(_queued(item))
        sched.add(req)

    items = trace.items
    k = steps = 0
    while True:
        while k < len(items) and ready(items[k]):
            enter(items[k])
            k += 1
        if sched.has_work():
            decision = sched.schedule()  # an engine step (engine.py `Engine.step`), the model replayed
            if decision:
                sched.update(decision, runner.forward(decision))
            steps += 1
            if steps > MAX_STEPS:
                raise EngineError(f"the simulation of {trace.source} did not finish in {MAX_STEPS} steps")
            continue
        if k >= len(items):
            break
        enter(items[k])  # the engine would sit idle until then: jump the clock
        k += 1
    return SimResult(policy, config.num_blocks, config.isolation, sched.hit_tokens, sched.query_tokens,
                     pool.evictions, sched.preemptions,
                     {rid: r.stats.cached_tokens for rid, r in reqs.items() if r.admitted_once}, events,
                     {rid: r.stats.miss for rid, r in reqs.items() if r.stats.miss is not None})


def _queued(item: TraceRequest):
    return RequestQueued(request_id=item.request_id, user=item.user, prompt_tokens=len(item.prompt_ids))


# --- many runs ---------------------------------------------------------------------------------
def default_sizes(trace: Trace) -> list[int]:
    """Pool sizes around the recorded one (none below what the longest request needs alone)."""
    n = trace.config.num_blocks
    low = trace.max_blocks_needed()
    sizes = {max(low, round(n * f)) for f in (0.5, 0.75, 1.0, 1.5, 2.0, 4.0)}
    return sorted(sizes | {n})


def simulate_grid(trace: Trace, sizes: list[int], policies: list[str], isolations: list[str],
                  progress=None) -> list[SimResult]:
    """Every (pool size, isolation, policy); Belady always runs too, to give `of_optimum`."""
    runs = [(n, iso, p) for iso in isolations for n in sizes for p in policies]
    need_opt = {(n, iso) for n, iso, _ in runs}
    done: dict[tuple, SimResult] = {}
    total = len(runs) + sum(1 for key in need_opt if "belady" not in policies)
    for i, (n, iso, p) in enumerate([(n, iso, "belady") for n, iso in sorted(need_opt)] + runs):
        if (n, iso, p) in done:
            continue
        if progress is not None:
            progress(len(done), total, f"{p} on {n} blocks, isolation {iso}")
        done[(n, iso, p)] = simulate(trace, n, p, iso)
    out = []
    for n, iso, p in runs:
        res = done[(n, iso, p)]
        opt = done[(n, iso, "belady")].hit_rate
        res.of_optimum = res.hit_rate / opt if opt > 0 else None
        out.append(res)
    return out


def headline(res: SimResult, opt: SimResult) -> str:
    """"LRU got 61 % of tokens, 94 % of the optimum (65 %)"."""
    s = f"{res.policy.upper()} got {res.hit_rate:.0%} of tokens".replace("%", " %")
    if opt.hit_rate > 0:
        s += f", {res.hit_rate / opt.hit_rate:.0%} of the optimum ({opt.hit_rate:.0%})".replace("%", " %")
    else:
        s += ", as did the optimum (no reuse was possible)"
    return s


def import_trace(db, read: ReadTrace, title: str | None = None) -> str:
    """Record a trace as a session (source "import"): its requests as turns, and the cache events
    of replaying it through the real scheduler and pool under the trace's settings, so the
    scrubber and the simulator open it like any recorded session."""
    trace = read.trace
    res = simulate(trace, keep_events=True)
    sid = new_ulid()
    reqs = trace.requests
    users = list(dict.fromkeys(r.user for r in reqs))
    cached = res.cached
    stats = {"hit_tokens": res.hit_tokens, "query_tokens": res.query_tokens, "hit_rate": res.hit_rate,
             "blocks_total": trace.config.num_blocks, "evictions": res.evictions, "preemptions": res.preemptions,
             "block_size": trace.config.block_size}
    finish = {ev.request_id: ev for ev, _ in res.events if type(ev).__name__ == "RequestFinished"}
    with write_txn(db):
        db["sessions"].insert({
            "id": sid, "created": time.time(), "ended": time.time(), "source": "import", "model": trace.model_key,
            "engine_config": _dumps(trace.config.to_dict()), "versions": _dumps(versions()), "system_prompt": "",
            "script_path": trace.source, "replay_of": None, "title": title or f"{read.format} trace {trace.source}",
            "stats": _dumps(stats)})
        for u in users:
            db["users"].upsert({"session_id": sid, "name": u}, pk=("session_id", "name"))
        rows = []
        for i, r in enumerate(reqs, 1):
            fin = finish.get(r.request_id)
            rows.append({
                "id": new_ulid(), "session_id": sid, "seq": i, "user": r.user, "text": f"request {i}", "reply": "",
                "messages": "[]", "sampling": _dumps({"max_tokens": max(1, len(r.output_ids))}), "seed": None,
                "at": None, "started": r.ts, "ended": r.ts, "request_id": r.request_id, "ttft_ms": None,
                "decode_tok_s": None, "prompt_tokens": len(r.prompt_ids), "cached_tokens": cached.get(r.request_id, 0),
                "computed_tokens": len(r.prompt_ids) - cached.get(r.request_id, 0), "output_tokens": len(r.output_ids),
                "cached_from": "{}", "preemptions": 0, "finish_reason": fin.finish_reason if fin else "stop",
                "error": fin.error if fin else None, "token_ids": _dumps(r.output_ids),
                "prompt_ids": _dumps(r.prompt_ids), "system_tokens": 0})
        db["turns"].insert_all(rows)
        steps: list = []  # [forwards, events]: one recorded batch per step of the simulated engine
        for ev, forwards in res.events:
            kind = type(ev).__name__
            if kind == "FirstToken":  # no model ran: no time to first token to show
                continue
            if kind == "RequestFinished":
                ev.stats = {k: (None if k.endswith("_ms") or k == "decode_tok_s" else v) for k, v in ev.stats.items()}
            if not steps or steps[-1][0] != forwards:
                steps.append((forwards, []))
            steps[-1][1].append(ev)
        insert_batch_rows(db, [batch_row(sid, ev_.EngineBatch(k, evs[-1].ts, evs, fw)) for k, (fw, evs) in enumerate(steps, 1)])
    return sid
