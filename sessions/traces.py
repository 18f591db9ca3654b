"""Block-level traces: what a session or a trace file put to the engine, request by request (the
simulator's input, sessions/simulate.py); read one out of a recorded session, and export or read
them as files other tools read (vLLM KV events, Mooncake-style request traces)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import msgpack

from kvplay.engine import events as ev_
from kvplay.engine.config import EngineConfig
from kvplay.engine.eviction import POLICIES
from kvplay.wire.codec import (AllBlocksCleared, BlockStored, EventBatch, WireError, decode_batch, decode_event,
                               encode_batch, event_to_wire)
from kvplay.wire.mirror import Mirror
from kvplay.wire.translate import FromWire, hash_key, to_wire

from .history import recorded_pool_size, session_batches
from .query import resolve_session, session_turns, session_users
from .store import StoreError


SIM_POLICIES = tuple(POLICIES) + ("belady",)  # what a trace replays under: the engine's policies and the optimum


# --- the trace ---------------------------------------------------------------------------------
@dataclass
class TraceRequest:
    request_id: str
    user: str
    prompt_ids: list[int]
    output_ids: list[int]
    group: str | None = None
    system_tokens: int = 0
    stop: bool = True  # ended on end-of-sequence after output_ids (else at len(output_ids) tokens)
    clock: int | None = None  # engine forward count when it was queued (None: one at a time)
    after: frozenset = frozenset()  # request ids that had finished before it was queued
    cached_tokens: int | None = None  # what the live run reused (None: not recorded)
    ts: float | None = None  # wall clock when it was queued


@dataclass
class Clear:
    """The cache was emptied (the app's "clear cache", a reconfigure) at this point."""
    clock: int | None = None
    after: frozenset = frozenset()
    reason: str = "cleared"


@dataclass
class Trace:
    config: EngineConfig  # the recorded settings, num_blocks resolved
    model_key: str  # the model name that keys block 0 of every chain
    items: list  # TraceRequest | Clear, in the order they reached the engine
    source: str = ""
    recorded_hit_tokens: int | None = None
    recorded_query_tokens: int | None = None
    final_settings: dict = field(default_factory=dict)  # isolation/eviction the session ended with

    @property
    def requests(self) -> list[TraceRequest]:
        return [it for it in self.items if isinstance(it, TraceRequest)]

    @property
    def recorded_hit_rate(self) -> float | None:
        if not self.recorded_query_tokens:
            return None if self.recorded_query_tokens is None else 0.0
        return self.recorded_hit_tokens / self.recorded_query_tokens

    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    def max_blocks_needed(self) -> int:
        """Blocks the longest request needs alone (a smaller pool fails it)."""
        bs = self.config.block_size
        return max((-(-(len(r.prompt_ids) + len(r.output_ids) + 1) // bs) for r in self.requests), default=1)


def session_config(session: dict, batches: list | None = None) -> EngineConfig:
    """The engine settings a session ran under, with the pool size resolved."""
    cfg = EngineConfig.from_dict(dict(session.get("engine_config") or {}), where=f"session {session['id']}: engine config")
    if cfg.num_blocks is None:
        n = recorded_pool_size(session, batches or [])
        if not n:
            raise StoreError(f"session {session['id']} did not record its pool size; "
                             "give --num-blocks to simulate it")
        cfg = cfg.replace(num_blocks=n)
    return cfg


def session_trace(db, ident: str) -> Trace:
    """The block-level trace of a recorded session: its turns in the order they reached the engine,
    each with the step clock and the requests finished before it (see sessions/simulate.py)."""
    session = resolve_session(db, ident)
    sid = session["id"]
    turns = {t["request_id"]: t for t in session_turns(db, sid) if t.get("request_id")}
    batches = session_batches(db, sid)
    groups = {u["name"]: u.get("group") for u in session_users(db, sid)}
    items: list = []
    finished: set[str] = set()
    queued: set[str] = set()
    for b in batches:
        for e in b.events:
            cls = type(e)
            if cls is ev_.RequestQueued and e.request_id in turns:
                t = turns[e.request_id]
                if not t.get("prompt_ids"):
                    raise StoreError(f"session {sid}: turn {t['seq']} has no recorded prompt token ids "
                                     "(recorded by an older kvplay); record it again to simulate it")
                items.append(TraceRequest(
                    t["request_id"], t["user"], list(t["prompt_ids"]), list(t.get("token_ids") or []),
                    group=groups.get(t["user"]), system_tokens=t.get("system_tokens") or 0,
                    stop=t.get("finish_reason") == "stop", clock=b.forwards,
                    after=frozenset(finished & set(turns)), cached_tokens=t.get("cached_tokens"), ts=e.ts))
                queued.add(t["request_id"])
            elif cls is ev_.RequestFinished:
                finished.add(e.request_id)
            elif cls is ev_.UserGroupChanged:
                groups[e.user] = e.new_group
            elif cls is ev_.AllBlocksCleared:
                items.append(Clear(b.forwards, frozenset(finished & set(turns)), e.reason or "cleared"))
    if not any(isinstance(i, TraceRequest) for i in items):
        if any(type(e) is ev_.BlockStored for b in batches for e in b.events) and not turns:
            return _stored_only_trace(session, batches)  # a watched server: requests from its block chains
        raise StoreError(f"session {sid} has no recorded requests to simulate")
    stats = session.get("stats") or {}
    hit, query = stats.get("hit_tokens"), stats.get("query_tokens")
    if hit is None:  # unfinished session: the turns' own counts
        done = [t for t in turns.values() if t.get("request_id") in queued and t.get("prompt_tokens")]
        hit = sum(t.get("cached_tokens") or 0 for t in done)
        query = sum(t["prompt_tokens"] for t in done if t.get("error") is None)
    return Trace(session_config(session, batches), session.get("model") or "", items,
                 source=f"session {sid}", recorded_hit_tokens=hit, recorded_query_tokens=query,
                 final_settings={k: stats.get(k) for k in ("isolation", "eviction")})


# --- export -----------------------------------------------------------------------------------
TRACE_FORMATS = ("vllm-jsonl", "vllm-msgpack", "mooncake")


def vllm_batches(batches: list) -> list:
    """A session's recorded batches as vLLM EventBatches, as `kvplay serve` publishes them
    (wire/translate.to_wire: consecutive stored blocks as one BlockStored with the creating user
    as session_id, one BlockRemoved per evicted block), batches without cache events left out."""
    out = (to_wire(b) for b in batches)
    return [b for b in out if b.events]


def _json_hash(h):
    return h.hex() if isinstance(h, (bytes, bytearray)) else h


def to_vllm_jsonl(batches: list) -> str:
    """One EventBatch per line, {"ts", "events"}, each event the map vLLM sends (uint64 hashes)."""
    lines = []
    for b in vllm_batches(batches):
        evs = []
        for e in (event_to_wire(ev) for ev in b.events):
            if "block_hashes" in e:
                e["block_hashes"] = [_json_hash(h) for h in e["block_hashes"]]
            if e.get("parent_block_hash") is not None:
                e["parent_block_hash"] = _json_hash(e["parent_block_hash"])
            evs.append(e)
        lines.append(json.dumps({"ts": b.ts, "events": evs}, separators=(",", ":")))
    return "\n".join(lines) + ("\n" if lines else "")


def to_vllm_msgpack(batches: list) -> bytes:
    """The EventBatch payloads, back to back (exactly the third frame of each ZMQ message)."""
    return b"".join(encode_batch(b) for b in vllm_batches(batches))


def _chain_ids(tokens: list[int], bs: int, ids: dict) -> list[int]:
    """Mooncake hash ids: one per block (the last one may be partial), numbered in order of first
    appearance, equal exactly when the whole prefix up to that block is equal."""
    out, parent = [], b""
    for i in range(0, len(tokens), bs):
        h = hashlib.sha256(parent + json.dumps(tokens[i:i + bs]).encode()).digest()
        out.append(ids.setdefault(h, len(ids)))
        parent = h
    return out


def to_mooncake(db, ident: str) -> str:
    """One JSON line per request, in arrival order: {timestamp (ms), input_length, output_length,
    hash_ids} with the session's block size (Mooncake's and aiperf's replay format)."""
    trace = session_trace(db, ident)
    bs = trace.config.block_size
    reqs = trace.requests
    t0 = min((r.ts for r in reqs if r.ts is not None), default=0.0)
    ids: dict = {}
    lines = []
    for r in reqs:
        lines.append(json.dumps({"timestamp": int(round(((r.ts or t0) - t0) * 1000)), "input_length": len(r.prompt_ids),
                                 "output_length": len(r.output_ids), "hash_ids": _chain_ids(r.prompt_ids, bs, ids)}))
    return "\n".join(lines) + ("\n" if lines else "")


# --- import -----------------------------------------------------------------------------------
class TraceError(StoreError):
    """A trace file that cannot be read (one line naming the record and field)."""


@dataclass
class ReadTrace:
    trace: Trace | None
    format: str
    records: int  # good records read
    error: str | None = None  # the first bad record, when the file is partial


TOKEN_BASE = 1 << 20  # synthesized prompt tokens live above every output token id


def _mooncake_records(lines, path: str, bs: int):
    """Yields (record number, dict) and raises TraceError naming the first bad one."""
    parent_of: dict[int, tuple] = {}
    for n, line in lines:
        where = f"{path} record {n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg}; truncated?)") from None
        if not isinstance(d, dict):
            raise TraceError(f"{where}: a Mooncake record is an object")
        for f in ("timestamp", "input_length", "output_length", "hash_ids"):
            if f not in d:
                raise TraceError(f"{where}: field {f!r} is missing (a Mooncake record has timestamp, "
                                 "input_length, output_length, hash_ids)")
        for f in ("timestamp", "input_length", "output_length"):
            if not isinstance(d[f], (int, float)) or isinstance(d[f], bool) or d[f] < 0:
                raise TraceError(f"{where}: field {f!r} must be a non-negative number, got {d[f]!r}")
        hs = d["hash_ids"]
        if not isinstance(hs, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hs):
            raise TraceError(f"{where}: field 'hash_ids' must be a list of non-negative integers")
        need = -(-int(d["input_length"]) // bs)
        if len(hs) != need or not hs:
            raise TraceError(f"{where}: field 'hash_ids' has {len(hs)} ids but input_length {d['input_length']} "
                             f"needs {need} blocks of {bs} tokens (give --block-size)")
        for k, h in enumerate(hs):
            link = (hs[k - 1] if k else None, k)
            if parent_of.setdefault(h, link) != link:
                raise TraceError(f"{where}: field 'hash_ids[{k}]': id {h} follows {link[0]} at block {k} here but "
                                 f"{parent_of[h][0]} at block {parent_of[h][1]} earlier (hashes do not chain)")
        yield n, d


def _mooncake_trace(recs: list[tuple[int, dict]], bs: int, source: str) -> list[TraceRequest]:
    out = []
    for n, d in recs:
        length = int(d["input_length"])
        toks: list[int] = []
        for h in d["hash_ids"]:
            toks += [TOKEN_BASE + h * bs + j for j in range(bs)]
        out.append(TraceRequest(f"r{n}", "trace", toks[:length], [7] * int(d["output_length"]),
                                stop=False, ts=float(d["timestamp"]) / 1000.0))
    return out


def _whole(batch):
    """A recorded batch is imported whole or refused: decode_batch skips a wrongly typed event
    (right for a live stream), a trace file with one is refused with one line."""
    if batch.bad_events:
        raise WireError(f"{batch.bad_events} event(s) with a wrongly typed or oversized field")
    return batch


def _vllm_batches_in(path: str, data: bytes):
    """Yields (record number, EventBatch) from msgpack payloads back to back or JSONL batches."""
    if data.lstrip()[:1] == b"{":
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path} record {n}: not JSON ({exc.msg}; truncated?)") from None
            if not isinstance(d, dict) or "events" not in d or "ts" not in d:
                raise TraceError(f"{path} record {n}: field 'events' or 'ts' is missing (not a vLLM EventBatch)")
            if not isinstance(d["events"], list) or not isinstance(d["ts"], (int, float)):
                raise TraceError(f"{path} record {n}: field 'events' must be a list and 'ts' a number")
            evs = []
            for k, e in enumerate(d["events"]):
                try:
                    ev = decode_event(e)
                except WireError as exc:
                    raise TraceError(f"{path} record {n}: field 'events[{k}]': {exc}") from None
                if ev is not None:
                    evs.append(ev)
            yield n, EventBatch(float(d["ts"]), evs, d.get("data_parallel_rank"))
        return
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, use_list=True)
    unpacker.feed(data)
    n = 0
    while True:
        n += 1
        try:
            obj = unpacker.unpack()
        except msgpack.OutOfData:
            if unpacker.tell() < len(data):
                raise TraceError(f"{path} record {n}: truncated msgpack ({len(data) - unpacker.tell()} bytes left)") from None
            return
        except Exception as exc:
            raise TraceError(f"{path} record {n}: not msgpack ({exc})") from None
        if n == 1 and isinstance(obj, dict) and isinstance(obj.get("frames"), list):
            # a capture of ZMQ messages (scripts/capture_vllm_events.py): {"frames": [[topic, seq, payload], …], …}
            for k, fr in enumerate(obj["frames"], 1):
                if not isinstance(fr, (list, tuple)) or not fr or not isinstance(fr[-1], (bytes, bytearray)):
                    raise TraceError(f"{path} record {k}: field 'frames[{k - 1}]' is not a [topic, seq, payload] message")
                try:
                    yield k, _whole(decode_batch(bytes(fr[-1])))
                except WireError as exc:
                    raise TraceError(f"{path} record {k}: {exc}") from None
            return
        try:
            yield n, _whole(decode_batch(msgpack.packb(obj, use_bin_type=True)))
        except WireError as exc:
            raise TraceError(f"{path} record {n}: {exc}") from None


def _requests_from_stored(batches, path: str) -> tuple[list, int, int, int]:
    """Requests rebuilt from BlockStored events: each one's prompt is its parent's chain plus its
    own blocks (plus one token, the one a server always computes); an event continuing the chain
    the same session's previous one ended is the same request (chunked prefill, decode blocks).
    A request reused its parent's chain, and any leading blocks it re-announces that were still
    cached (vLLM's kv_cache_report_mode "full"). What is cached is the one Mirror's picture
    (wire/mirror.py, fed every event in order). Returns the items, the hits the server got, the
    prompt tokens and the peak of blocks resident (a lower bound of its pool)."""
    chain: dict = {}  # hash -> tokens of the whole prefix up to and including that block
    items: list = []
    mirror = Mirror(pod="trace")
    from_wire = FromWire(mirror)
    resident = mirror.key_slot
    peak = hits = 0
    open_: dict = {}  # session id (user) -> (its latest request, the hash its chain ends with)
    for n, b in batches:
        for k, ev in enumerate(b.events):
            if isinstance(ev, BlockStored):
                bs = ev.block_size
                if not bs or len(ev.token_ids) != bs * len(ev.block_hashes):
                    raise TraceError(f"{path} record {n}: field 'events[{k}].token_ids' has {len(ev.token_ids)} tokens "
                                     f"for {len(ev.block_hashes)} blocks of {bs}")
                p = ev.parent_block_hash
                if p is not None and p not in chain:
                    raise TraceError(f"{path} record {n}: field 'events[{k}].parent_block_hash': {p!r} was never "
                                     "stored (hashes do not chain)")
                prefix = [] if p is None else chain[p]
                reused = len(prefix)  # vLLM stores a block only under a cached parent
                for h in ev.block_hashes:  # re-announced cached blocks (kv_cache_report_mode "full") are hits
                    if hash_key(h) not in resident or reused != len(chain.get(h, ())) - bs:
                        break
                    reused += bs
                for i, h in enumerate(ev.block_hashes):
                    prefix = prefix + list(ev.token_ids[i * bs:(i + 1) * bs])
                    chain[h] = prefix
                uid = ev.session_id if isinstance(ev.session_id, str) and ev.session_id else "vllm"
                cur, tail = open_.get(uid, (None, None))
                if cur is not None and p is not None and p == tail:
                    cur.prompt_ids = prefix + [cur.prompt_ids[-1]]
                else:
                    cur = TraceRequest(f"r{len(items) + 1}", uid, prefix + [TOKEN_BASE - 1 - len(items) % 1000],
                                       [], stop=True, ts=b.ts)
                    cur.cached_tokens = reused
                    hits += cur.cached_tokens
                    items.append(cur)
                open_[uid] = (cur, ev.block_hashes[-1] if ev.block_hashes else tail)
            elif isinstance(ev, AllBlocksCleared):
                items.append(Clear(None, frozenset(), "cleared"))
                open_.clear()
            mirror.apply(from_wire(EventBatch(b.ts, [ev])))
            peak = max(peak, len(resident))
    query = sum(len(r.prompt_ids) for r in items if isinstance(r, TraceRequest))
    return items, hits, query, peak


def detect_format(data: bytes) -> str:
    head = data.lstrip()[:1]
    if head != b"{":
        return "vllm"
    first = data.lstrip().split(b"\n", 1)[0]
    try:
        d = json.loads(first)
    except json.JSONDecodeError:
        return "vllm"
    return "mooncake" if isinstance(d, dict) and "hash_ids" in d else "vllm"


def read_trace_file(path: str, fmt: str = "auto", block_size: int = 16, num_blocks: int | None = None,
                    policy: str = "lru", isolation: str = "shared") -> ReadTrace:
    """A trace file (vLLM KV events as JSONL or msgpack payloads, or a Mooncake JSONL trace) as a
    Trace for the simulator. A bad record stops the reading: what came before it is kept and
    `error` names the record and the field."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise TraceError(f"{path} is empty")
    fmt = detect_format(data) if fmt == "auto" else fmt
    error = None
    good: list = []
    try:
        if fmt == "mooncake":
            lines = [(n, line) for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1) if line.strip()]
            for rec in _mooncake_records(lines, path, block_size):
                good.append(rec)
        else:
            for rec in _vllm_batches_in(path, data):
                good.append(rec)
    except TraceError as exc:
        error = str(exc)
    if not good:
        raise TraceError(error or f"{path}: no records")
    if fmt == "mooncake":
        items = _mooncake_trace(good, block_size, path)
        hits = query = None
        bs = block_size
        peak = 0
    else:
        items, hits, query, peak = _requests_from_stored(good, path)
        bs = next((ev.block_size for _, b in good for ev in b.events if getattr(ev, "block_size", 0)), block_size)
        if not any(isinstance(i, TraceRequest) for i in items):
            raise TraceError(error or f"{path}: no BlockStored events, so no requests to rebuild")
    trace = Trace(EngineConfig(model="trace", block_size=bs, num_blocks=1, isolation=isolation, eviction=policy),
                  "trace", items, source=path, recorded_hit_tokens=hits, recorded_query_tokens=query)
    n = num_blocks or max(peak, 2 * trace.max_blocks_needed())
    trace.config = trace.config.replace(num_blocks=n)
    return ReadTrace(trace, fmt, len(good), error)


def _stored_only_trace(session: dict, batches: list) -> Trace:
    """A session that recorded blocks but no requests (`kvplay watch` of a real server): its
    requests rebuilt from the stored chains, as for an imported vLLM capture (the recorded
    batches in vLLM's form, wire/translate.to_wire)."""
    wire = [(n, to_wire(b)) for n, b in enumerate(batches, 1)]
    items, hits, query, peak = _requests_from_stored([(n, b) for n, b in wire if b.events], f"session {session['id']}")
    bs = next((e.block_size for b in batches for e in b.events if type(e) is ev_.BlockStored and e.block_size), 16)
    trace = Trace(EngineConfig(model="trace", block_size=bs, num_blocks=1), "trace", items,
                  source=f"session {session['id']} (blocks only)", recorded_hit_tokens=hits, recorded_query_tokens=query)
    trace.config = trace.config.replace(num_blocks=max(peak, 2 * trace.max_blocks_needed()))
    return trace
