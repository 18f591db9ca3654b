"""A ChatBackend over a remote OpenAI-compatible server and its KV events (`kvplay attach`).

Chat: each pane's turn is a streamed ``POST /v1/chat/completions`` with the pane's user as
``user`` and ``session_id`` and ``vllm_xargs.kv_cache_report_mode = "full"`` (so what it reuses
is re-announced as events), ``stream_options.include_usage`` for ``cached_tokens``. TTFT is
measured here, at the client. Per turn "from whom": the re-announced blocks (``BlockHit``
events) of that session that arrive while the turn runs, by the session that stored them.

Cache: the pods' KV events (wire/subscriber.py) are translated into engine batches (each pod's
`FromWire`, wire/translate.py) that feed a `Fleet` of `Mirror`s (wire/mirror.py, the mirror every
cache view reads), one per pod; the same batches go to this backend's batch subscribers
(`subscribe_batches`), so the app's views and recorder read the same events as from a local
engine. vLLM sends no block ids, so a pod's translator gives every cached block a slot (the
lowest free one) and the events carry those ids; pod k's slots follow pod k-1's. Every mirrored
block is "cached": the events do not say which ones running requests hold.

Predicted vs delivered: before a turn is sent, its prompt's token ids (the server's `/tokenize`)
are matched against the mirrored blocks (wire/tree.PrefixMatcher, per pod, the best pod counts):
`RemoteStats.predicted_tokens`; after it, the server's `usage.prompt_tokens_details.cached_tokens`
is what was delivered. `stats()` counts the turns predicted and those where the two differ (a
stale mirror, an eviction or store the events did not show). Each pod's PrefixMatcher is kept up
to date from the translated events as batches arrive, so a prediction costs O(prompt), not
O(blocks).

Salts: a server that hashes blocks with extra keys (vLLM's and SGLang's `cache_salt`, kvplay
serve's per-user or per-group isolation salt) lists them per block in its events (`extra_keys`);
the matcher keys blocks by them too. Which salt a pane's requests get is the server's business
(bound to its API key, never chosen here): it is learned from the events of the pane's session —
the `session_id` the server publishes, which is the pane's user, or the identity the server bound
to our key when its answers name one (kvplay serve's `kvplay.user`). Until then a prompt that only
blocks under other salts would match is "cannot know" (`predicted_tokens` None, `unpredictable`
set: not counted, not a mismatch).

A server's text is data (kvplay/inert.py): what it answers is checked for its type and size and
made valid Unicode (`scalars`) where it enters; the views show it inert. A malformed answer ends
that turn with an error, never the thread that streams it.

No Textual here: usable and testable without the app.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import httpx
import numpy as np

from kvplay.engine.errors import EngineError
from kvplay.engine.events import AllBlocksCleared, BlockHit, BlockRemoved, BlockStored, EngineBatch
from kvplay.engine.request import RequestResult, RequestStats, TokenDelta

from kvplay.inert import inert, scalars

from .chat_backend import ChatBackend, Controls
from .mirror import Fleet, Mirror
from .miss_watch import MissWatch
from .subscriber import TROUBLE, PodSource, Subscriber
from .views import BlockArrays, summarize
from .tree import PrefixMatcher, frozen_extra

DEFAULT_SLOTS = 4096
MAX_PROMPT_IDS = 1 << 20  # token ids taken from a server's /tokenize answer
MAX_SALT_SESSIONS = 4096  # sessions whose salts are remembered (the oldest go first)
MAX_SALTS = 8             # salts remembered per session
MAX_MODEL_ID = 1024       # characters of a model id from /v1/models
MAX_TEXT = 1 << 20        # characters of one /detokenize answer or one streamed reply kept


def detokenize(http: httpx.Client, model: str | None, token_ids) -> str:
    """Text of token ids through a server's ``POST /detokenize`` (vLLM's, SGLang's, kvplay
    serve's) on `http`; "" when it has none or answers something else. The text is made valid
    Unicode and cut at `MAX_TEXT` (views show it inert)."""
    body = {"tokens": list(token_ids)}
    if model:
        body["model"] = model
    try:
        r = http.post("/detokenize", json=body, timeout=5)
        answer = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return ""
    text = answer.get("prompt") if isinstance(answer, dict) else None
    return scalars(text[:MAX_TEXT]) if isinstance(text, str) else ""


class ServerDetokenizer:
    """A server's /detokenize as a callable `ids -> text` ("" when it cannot), for `kvplay watch
    URL`'s branch texts; `close()` when done."""

    def __init__(self, url: str, api_key: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=5)

    def __call__(self, token_ids) -> str:
        return detokenize(self._http, None, token_ids)

    def close(self) -> None:
        self._http.close()


class PodRange:
    """One pod's slots of a RemoteBackend as a block-map source of their own (a fleet shows one
    map per pod): block 0 here is the backend's block `offset`."""

    def __init__(self, backend: "RemoteBackend", pod: str):
        self.backend, self.pod = backend, pod

    @property
    def offset(self) -> int:
        return self.backend.pods[self.pod].offset

    @property
    def num_blocks(self) -> int:
        return self.backend.pods[self.pod].num_blocks

    @property
    def version(self) -> int:
        return self.backend._version

    def arrays(self, start: int = 0, stop: int | None = None):
        with self.backend._lock:  # the pod's own mirror: right even after a pod before it grew
            return self.backend.pods[self.pod].arrays(start, stop)

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None):
        with self.backend._lock:
            arrays, total = self.backend.pods[self.pod].used_arrays(start, stop)
        return summarize(arrays, cells, user, total=total)

    def block(self, block_id: int):
        return self.backend.block(self.offset + block_id) if 0 <= block_id < self.num_blocks else None


@dataclass
class RemoteStats(RequestStats):
    """A remote turn's stats, plus the cached tokens the mirror predicted before it was sent
    (None: no prediction, e.g. no KV events, or the server has no /tokenize; `unpredictable`:
    the server's salt decides and it is not known yet)."""
    predicted_tokens: int | None = None
    unpredictable: bool = False


class RemoteTurn:
    """One streamed turn: iterate for TokenDeltas (`.text`), then `result()`."""

    def __init__(self, request_id: str, user: str):
        self.request_id = request_id
        self.user = user
        self._queue: queue.Queue = queue.Queue()
        self._result: RequestResult | None = None
        self._done = threading.Event()

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            yield item

    def result(self, timeout: float | None = None) -> RequestResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"turn {self.request_id} not finished after {timeout} s")
        return self._result

    def _finish(self, result: RequestResult) -> None:
        self._result = result
        self._done.set()
        self._queue.put(None)


def _count(v) -> int:
    """A token count from a server's `usage`: a non-negative int, else 0."""
    return v if type(v) is int and 0 <= v < 1 << 40 else 0


def remote_controls(url: str) -> Controls:
    """A server decides its own isolation, eviction and determinism, and labs run on kvplay's
    own engine; F4 asks the server to reset its prefix cache (POST /reset_prefix_cache)."""
    def server(what: str, how: str) -> str:
        return f"{what} is the server's setting, not switchable from kvplay attach: {how}"

    return Controls(clear=True, why={
        "isolation": server("Isolation", "vLLM shares blocks unless a request sends cache_salt; "
                            "kvplay serve isolates by API key with --isolation."),
        "eviction": server("Eviction", "vLLM evicts least recently used free blocks; kvplay serve takes --eviction."),
        "deterministic": server("Deterministic mode", "vLLM: VLLM_BATCH_INVARIANT=1; kvplay serve: --deterministic."),
        "groups": server("A user's group", "kvplay serve binds it to the API key (keys file); vLLM has none."),
        "labs": f"Labs run on kvplay's own engine. To measure this server: kvplay lab leak|determinism "
                f"--target {url}",
    })


class RemoteBackend(ChatBackend):
    """A ChatBackend over HTTP + KV events (no Textual import)."""

    def __init__(self, url: str, api_key: str | None = None, sources: list[PodSource] = (),
                 model: str | None = None, timeout: float = 300.0, slots: int | None = None):
        self.url = url.rstrip("/")
        self.controls = remote_controls(self.url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.model_name = model or self._first_model()
        self.device = self.url
        self.fleet = Fleet()
        self.users: list[str] = []
        self._user_code: dict[str, int] = {}
        self._listeners: list[Callable] = []
        self._lock = self.fleet.lock  # the subscriber applies batches under it; views read under it
        self._version = 0
        self._block_size = 0
        self._query_tokens = self._hit_tokens = self._finished = 0
        self._predicted = self._mispredicted = 0  # turns with a prediction, ... that the server's usage contradicted
        self._unpredictable = 0  # turns the server's salt decided before we had learned it
        self._can_tokenize = True
        self._matchers: dict[str, PrefixMatcher] = {}  # pod -> its cached blocks by (parent, tokens, extra keys)
        self._salts: OrderedDict = OrderedDict()  # session -> {extra keys its blocks carry}
        self._identity: str | None = None  # who the server says our key is (kvplay serve's kvplay.user)
        self._hits: dict[str, list] = {}  # session -> [(time, {creator: tokens})] recently re-announced
        self.misses = MissWatch(self.fleet, explain=True)  # why each pod computed what it did
        capacity = slots or self._server_blocks() or DEFAULT_SLOTS
        self.pods: dict[str, Mirror] = {}
        for k, src in enumerate(sources):
            self.pods[src.name] = self.fleet.pod(src.name, capacity, offset=k * capacity)
        self._sub = None
        self._thread = None
        self._join_waited = False  # a turn has waited for the join replays (later ones do not)
        if sources:
            try:
                self._sub = Subscriber(list(sources), self.fleet, on_batch=self._on_batch,
                                       on_restart=self._on_restart).open()
            except EngineError:
                self._http.close()
                raise
            self._thread = threading.Thread(target=self._sub.run, name="kvplay-attach-events", daemon=True)
            self._thread.start()

    # --- server discovery ---------------------------------------------------------------------
    def _get(self, path: str) -> httpx.Response:
        try:
            return self._http.get(path, timeout=10)
        except httpx.HTTPError as exc:
            raise EngineError(f"cannot reach {self.url}: {exc}") from None

    def _first_model(self) -> str:
        r = self._get("/v1/models")
        if r.status_code == 401:
            raise EngineError(f"{self.url} refused the API key (401): give --api-key")
        if r.status_code != 200:
            raise EngineError(f"{self.url}/v1/models answered HTTP {r.status_code}: not an OpenAI-compatible server?")
        try:
            model = r.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EngineError(f"{self.url}/v1/models lists no model") from None
        if not isinstance(model, str) or not model or len(model) > MAX_MODEL_ID:
            raise EngineError(f"{self.url}/v1/models lists no usable model id ({inert(repr(model), limit=80)})")
        return model

    def _server_blocks(self) -> int | None:
        """The pool size from /metrics, if it says: vLLM's `cache_config_info` num_gpu_blocks, or
        kvplay serve's `kvplay:blocks` gauges (by state) summed."""
        try:
            r = self._http.get("/metrics", timeout=5)
        except httpx.HTTPError:
            return None
        kvplay_blocks = 0.0
        for line in r.text.splitlines() if r.status_code == 200 else ():
            if line.startswith("vllm:cache_config_info{") and 'num_gpu_blocks="' in line:
                v = line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0]
                if v.isdigit() and int(v) > 0:
                    return int(v)
            elif line.startswith("kvplay:blocks{"):
                try:
                    kvplay_blocks += float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    pass
        return int(kvplay_blocks) or None

    def clear_cache(self) -> int | None:
        """``POST /reset_prefix_cache`` (vLLM serves it only with VLLM_SERVER_DEV_MODE=1): the
        blocks dropped when the server says, else None. A refusal is one line (EngineError). The
        mirror empties when the server's AllBlocksCleared event arrives (vLLM: with its next step)."""
        try:
            r = self._http.post("/reset_prefix_cache", timeout=60)
        except httpx.HTTPError as exc:
            raise EngineError(f"cannot reach {self.url}: {exc}") from None
        if r.status_code in (404, 405):
            raise EngineError(f"{self.url} does not offer /reset_prefix_cache (vLLM: start it with "
                              "VLLM_SERVER_DEV_MODE=1)")
        if r.status_code in (401, 403):
            raise EngineError(f"{self.url} refused /reset_prefix_cache (HTTP {r.status_code}) for this API key")
        if r.status_code != 200:
            raise EngineError(f"{self.url}/reset_prefix_cache answered HTTP {r.status_code}")
        try:
            n = r.json().get("dropped_blocks")
        except (ValueError, AttributeError):
            return None
        return n if isinstance(n, int) else None

    # --- events -------------------------------------------------------------------------------
    def _code(self, user: str) -> int:
        c = self._user_code.get(user)
        if c is None:
            c = self._user_code[user] = len(self.users)
            self.users.append(user)
        return c

    def _on_restart(self, pod: str, batch: EngineBatch) -> None:
        """The pod's publisher restarted: the subscriber cleared its mirror; views hear it."""
        with self._lock:
            self._matchers.pop(pod, None)
            self.misses.on_batch(pod, batch)
            self._version += 1
        self._hand_over(batch)

    def _hand_over(self, batch: EngineBatch) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(batch)
            except Exception:  # a view's error must not stop the mirror (it runs on our thread)
                pass

    def _on_batch(self, pod: str, seq: int, batch: EngineBatch, replayed: bool) -> None:
        now = time.monotonic()
        extras = self._extras(batch)
        with self._lock:
            matcher = self._matchers.setdefault(pod, PrefixMatcher())
            for ev in batch.events:  # the prediction's index, kept as the mirror changes
                cls = type(ev)
                if cls is BlockStored:
                    self._code(ev.user)
                    self._block_size = ev.block_size or self._block_size
                    parent, size, toks = ev.parent_block_hash, ev.block_size, ev.token_ids
                    for i, h in enumerate(ev.block_hashes):
                        matcher.add(h, parent, toks[i * size:(i + 1) * size], extras.get(h))
                        parent = h
                elif cls is BlockHit:
                    self._hits.setdefault(ev.user, []).append((now, dict(ev.by_creator)))
                elif cls is BlockRemoved:
                    for h in ev.block_hashes:
                        matcher.remove(h)
                elif cls is AllBlocksCleared:
                    matcher.clear()
            self.misses.on_batch(pod, batch)
            self._version += 1
        self._hand_over(batch)
        # Let the app's thread in. A busy server keeps this thread computing; each time the UI
        # thread waits in select() it must take the GIL back, which takes up to the 5 ms switch
        # interval from a thread that never blocks: its loop crawled (~100 ms lags at 50,000
        # events/s). Releasing it after every batch hands it over at once.
        time.sleep(0)

    def _extras(self, batch: EngineBatch) -> dict:
        """{block hash: its extra keys} of a batch's announced blocks (stored or announced again)
        that have any, hashable; each session's salts are remembered on the way (what its
        requests get hashed with)."""
        out = {}
        for ev in batch.events:
            cls = type(ev)
            keys = ev.extra_keys if cls is BlockStored or cls is BlockHit else None
            if not keys:
                continue
            for h, x in zip(ev.block_hashes, keys):
                if not x and x != 0:  # None, or an empty list: no extra keys
                    continue
                x = out[h] = frozen_extra(x)
                sid = ev.user
                if not sid or x == "?":
                    continue
                with self._lock:
                    salts = self._salts.get(sid)
                    if salts is None:
                        salts = self._salts[sid] = {}
                        if len(self._salts) > MAX_SALT_SESSIONS:
                            self._salts.popitem(last=False)
                    salts[x] = None
                    if len(salts) > MAX_SALTS:
                        del salts[next(iter(salts))]
        return out

    def subscribe_batches(self, fn: Callable) -> Callable[[], None]:
        """Call `fn(batch)` with each pod's applied batch as an EngineBatch (on the subscriber's
        thread), as an Engine does: the recorder and the app's views read them."""
        with self._lock:
            self._listeners.append(fn)

        def unsubscribe():
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)
        return unsubscribe

    # --- chat ---------------------------------------------------------------------------------
    def register_user(self, name: str, group: str | None = None) -> None:
        """The server binds identity (its API keys); here a pane's user is only its session."""
        with self._lock:
            self._code(name)

    def submit(self, user: str, messages: list[dict], sampling=None) -> RemoteTurn:
        rid = f"attach-{uuid.uuid4().hex[:12]}"
        turn = RemoteTurn(rid, user)
        body = {"model": self.model_name, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, "user": user, "session_id": user,
                "vllm_xargs": {"kv_cache_report_mode": "full"}}
        if sampling is not None:
            body.update(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens)
            if sampling.top_k:
                body["top_k"] = sampling.top_k
            if sampling.seed is not None:
                body["seed"] = sampling.seed
        threading.Thread(target=self._stream, args=(turn, body), name=f"kvplay-attach-{rid}", daemon=True).start()
        return turn

    def tokenize(self, messages: list[dict]) -> list[int] | None:
        """The prompt's token ids from the server's /tokenize (vLLM's, kvplay serve's); None when
        it has none (asked once) or answers something else."""
        if not self._can_tokenize:
            return None
        try:
            r = self._http.post("/tokenize", json={"model": self.model_name, "messages": messages}, timeout=10)
        except httpx.HTTPError:
            return None
        if r.status_code in (404, 405):
            self._can_tokenize = False
            return None
        try:
            ids = r.json().get("tokens") if r.status_code == 200 else None
        except (ValueError, AttributeError):
            return None
        if not isinstance(ids, list) or len(ids) > MAX_PROMPT_IDS or not all(type(t) is int for t in ids):
            return None
        return ids

    def predict(self, user: str, messages: list[dict]) -> int | None:
        """The cached tokens the mirror says this prompt should get (the best pod's prefix match),
        before it is sent; the prompt is registered for attribution. None without events or
        /tokenize, when the salt decides and is not known (`salts_of`), or when the pods' join
        replays did not end within the replay timeout (the mirror may lack older blocks)."""
        return self._predict(user, messages)[0]

    def _predict(self, user: str, messages: list[dict]) -> tuple[int | None, bool, list | None]:
        """(prediction, whether it is None because the salt is not known, the prompt's token ids
        when the mirror is complete enough to explain the turn after it)."""
        if self._sub is None:
            return None, False, None
        ids = self.tokenize(messages)
        if ids is None:
            return None, False, None
        with self.fleet.lock:
            self.fleet.prompts.register(user, ids)
        # Before the pods' join replays are over the mirror lacks what they cached before we came:
        # a prediction then says 0 where the server hits. Wait for them once, bounded.
        joined = self._sub.wait_joined(0.0 if self._join_waited else self._sub.replay_timeout + 1.0)
        self._join_waited = True
        if not joined:
            return None, False, None
        with self._lock:
            salts = self.salts_of(user)
            got = [mt.predicted_hit(ids, salts) for mt in self._matchers.values()]
        if None in got:
            return None, True, ids
        return max(got, default=0), False, ids

    def explain(self, user: str, ids: list[int], prompt_tokens: int, cached_tokens: int,
                wait: float = 1.0) -> dict | None:
        """Why a finished turn's uncached prompt tokens were computed (the miss object of
        engine/miss.py), after the fact: its prompt (`ids`, the server's /tokenize) walked
        through the mirror of the pod that holds most of it, once its own stored blocks are there
        (events come after the server's step: up to `wait` s), and explained by that pod's
        attribution (wire/miss_watch.py `explain_prompt`). None when the mirror cannot tell:
        no events, a prompt /tokenize counted otherwise than the usage, a cached prefix the mirror
        does not hold."""
        if self._sub is None or len(ids) != prompt_tokens or not ids:
            return None
        end = time.monotonic() + wait
        while True:
            with self._lock:
                bs = self._block_size  # (known from the first stored block on)
                salts = self.salts_of(user)
                best, keys = None, []
                for pod, mt in self._matchers.items():
                    k = mt.chain(ids, salts)
                    if best is None or len(k) > len(keys):
                        best, keys = pod, k
            if (bs and best is not None and len(keys) >= (len(ids) - 1) // bs) or time.monotonic() >= end:
                break
            time.sleep(0.02)
        if best is None or not bs:
            return None
        # the excerpts' text comes from the server's /detokenize, never asked under the lock (the
        # events wait on it): a first pass notes the token runs it needs, a second has them
        texts: dict = {}
        wanted: list = []

        def known(token_ids) -> str:
            text = texts.get(tuple(token_ids))
            if text is None:
                wanted.append(list(token_ids))
                return ""
            return text

        salt = salts[0] if salts else None
        pm = self.misses.pod(best)
        with self._lock:
            pm.tracker.decode = known
            miss = pm.explain_prompt(ids, keys, cached_tokens, bs, salt)
        if miss is None or not wanted or not miss["reasons"]["diverged"]:
            return miss
        for token_ids in wanted[:3]:
            texts[tuple(token_ids)] = self.decode(token_ids)
        with self._lock:
            pm.tracker.decode = known
            return pm.explain_prompt(ids, keys, cached_tokens, bs, salt)

    def salts_of(self, user: str) -> list | None:
        """The extra keys this pane's requests are hashed with, as learned from the events of its
        session on the server (the identity the server bound to our key, when it says; else the
        pane's user, which the requests send as session_id); None: not seen yet."""
        with self._lock:
            salts = self._salts.get(self._identity or user)
            return list(salts) if salts else None

    def _stream(self, turn: RemoteTurn, body: dict) -> None:
        stats = RemoteStats(turn.request_id, turn.user)
        stats.predicted_tokens, stats.unpredictable, ids = self._predict(turn.user, body["messages"])
        text, finish, error = [], "stop", None
        t0 = time.monotonic()
        usage, size = None, 0
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    try:
                        error = r.json()["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        error = r.text
                    error = f"HTTP {r.status_code}: {scalars(str(error)[:200])}"
                else:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        self._learn_identity(chunk.get("kvplay"))
                        for ch in chunk.get("choices") or ():
                            piece = (ch.get("delta") or {}).get("content") or ""
                            if not isinstance(piece, str):
                                raise ValueError(f"a streamed delta's content is {type(piece).__name__}, not text")
                            piece = scalars(piece[:MAX_TEXT - size])
                            size += len(piece)
                            if piece:
                                if stats.ttft_ms is None:
                                    stats.ttft_ms = (time.monotonic() - t0) * 1000
                                turn._queue.put(TokenDelta(turn.request_id, piece, -1, len(text)))
                                text.append(piece)
                            finish = ch.get("finish_reason") or finish
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # a malformed answer too
            error = f"{type(exc).__name__}: {scalars(str(exc)[:200])}"
        finish = finish if isinstance(finish, str) and len(finish) <= 64 else "stop"
        stats.total_ms = (time.monotonic() - t0) * 1000
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            stats.prompt_tokens = _count(usage.get("prompt_tokens"))
            stats.output_tokens = _count(usage.get("completion_tokens"))
            stats.cached_tokens = _count(details.get("cached_tokens") if isinstance(details, dict) else None)
            stats.computed_tokens = stats.prompt_tokens - stats.cached_tokens
        if stats.output_tokens and stats.ttft_ms is not None and stats.total_ms > stats.ttft_ms:
            stats.decode_tok_s = max(0, stats.output_tokens - 1) / ((stats.total_ms - stats.ttft_ms) / 1000)
        stats.cached_from = self._cached_from(turn.user, t0, stats.cached_tokens)
        if error is None and ids is not None and stats.prompt_tokens:
            stats.miss = self.explain(turn.user, ids, stats.prompt_tokens, stats.cached_tokens)
        stats.finish_reason = finish if error is None else "error"
        with self._lock:
            self._finished += 1
            self._query_tokens += stats.prompt_tokens
            self._hit_tokens += stats.cached_tokens
            if stats.predicted_tokens is not None and error is None:
                self._predicted += 1
                self._mispredicted += stats.predicted_tokens != stats.cached_tokens
            self._unpredictable += stats.unpredictable and error is None
        turn._finish(RequestResult(turn.request_id, turn.user, "".join(text), [], stats, stats.finish_reason, error))

    def _learn_identity(self, ext) -> None:
        """kvplay serve names the user it bound to our key (`kvplay.user`): the session whose
        events carry our salt."""
        who = ext.get("user") if isinstance(ext, dict) else None
        if isinstance(who, str) and 0 < len(who) <= 256 and who != self._identity:
            with self._lock:
                self._identity = who

    def _cached_from(self, user: str, since: float, cached: int, wait: float = 1.0) -> dict[str, int]:
        """The creators of what this turn reused: its session's re-announced blocks since it
        started (events come after the server's step; wait up to `wait` s for them)."""
        if not cached or self._sub is None:
            return {}
        end = time.monotonic() + wait
        while True:
            with self._lock:
                got = [by for t, by in self._hits.get(user, ()) if t >= since]
            total = sum(sum(by.values()) for by in got)
            if total >= cached or time.monotonic() >= end:
                break
            time.sleep(0.02)
        out: dict[str, int] = {}
        for by in got:
            for who, n in by.items():
                out[who] = out.get(who, 0) + n
        return out

    # --- the pool as the views read it ----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.pods.values()) or DEFAULT_SLOTS

    def stats(self, timeout: float = 0.0) -> dict:
        with self._lock:
            cached = sum(len(m.key_slot) for m in self.pods.values())
            total = self.num_blocks
            return {"model": self.model_name, "blocks_total": total, "blocks_free": total - cached,
                    "blocks_cached": cached, "blocks_in_use": 0, "block_size": self._block_size,
                    "query_tokens": self._query_tokens, "hit_tokens": self._hit_tokens,
                    "hit_rate": self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
                    "evictions": sum(m.removed for m in self.fleet.pods.values()),
                    "preemptions": 0, "collisions_caught": 0, "requests_finished": self._finished,
                    "running": 0, "waiting": 0, "isolation": "remote", "eviction": "remote",
                    "deterministic": False, "hash": "remote", "verify_on_hit": False,
                    "pods": {name: m.pod_state for name, m in self.fleet.pods.items()},
                    "predicted_turns": self._predicted, "mispredicted_turns": self._mispredicted,
                    "unpredictable_turns": self._unpredictable,
                    "pod_trouble": self._pod_trouble()}

    def _pod_trouble(self) -> dict:
        """Per pod, the subscriber's non-zero counts of why its mirror may be partial."""
        sub = self._sub
        if sub is None:
            return {}
        out = {}
        for name in self.fleet.pods:
            info = sub.pod_info(name)
            out[name] = {k: info[k] for k in TROUBLE if info.get(k)}
        return out

    @property
    def version(self) -> int:
        """Bumped by every applied batch: the map redraws when it moves (no copy, no lock)."""
        return self._version

    def arrays(self, start: int = 0, stop: int | None = None):
        """The blocks [start, stop) of all pods, pod after pod: only the pods' slices in range
        are copied (the map asks for a window of a pool of hundreds of thousands)."""
        with self._lock:
            stop = self.num_blocks if stop is None else min(stop, self.num_blocks)
            states, creators = [], []
            for m in self.pods.values():
                at = m.offset
                lo, hi = max(start, at), min(stop, at + m.num_blocks)
                if lo < hi:
                    part = m.arrays(lo - at, hi - at)
                    codes = np.array([self._code(u) for u in part.users] + [-1], np.int32)
                    states.append(part.state)
                    creators.append(codes[part.creator])  # the pod's user codes -> the backend's
            state = np.concatenate(states) if states else np.zeros(0, np.int8)
            creator = np.concatenate(creators) if creators else np.zeros(0, np.int32)
            return BlockArrays(self._version, start, state, creator, tuple(self.users))

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None):
        return summarize(self.arrays(start, stop), cells, user)

    def block(self, block_id: int):
        with self._lock:
            for m in self.pods.values():
                if 0 <= block_id - m.offset < m.num_blocks:
                    v = m.block(block_id - m.offset)
                    return None if v is None else dataclasses.replace(v, block_id=block_id)
        return None

    def decode(self, token_ids) -> str:
        """Text of token ids through the server's /detokenize (vLLM's); "" when it has none."""
        return detokenize(self._http, self.model_name, token_ids)

    def close(self, timeout: float = 1.0) -> None:
        if self._sub is not None:
            self._sub.stop()
            if self._thread is not None:
                self._thread.join(timeout)
            self._sub.close()
            self._sub = None
        self._http.close()
