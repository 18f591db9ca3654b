"""A request (one user turn) as the scheduler sees it, its stats, and the client's handle."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

from .errors import EngineError
from .sampling_params import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class RequestStats:
    request_id: str
    user: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the pool at first admission
    cached_from: dict[str, int] = field(default_factory=dict)  # creator user -> tokens
    computed_tokens: int = 0  # prompt tokens computed at first admission
    recomputed_tokens: int = 0  # extra tokens computed again after preemption
    output_tokens: int = 0
    ttft_ms: float | None = None
    decode_tok_s: float | None = None
    queued_ms: float | None = None
    total_ms: float | None = None
    preemptions: int = 0
    collisions_caught: int = 0
    finish_reason: str | None = None
    seed: int | None = None  # the sampling seed actually used (replays need it)
    miss: dict | None = None  # why the uncached prompt tokens were computed (engine/miss.py)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenDelta:
    """A piece of streamed text (may be empty while a multi-byte character is incomplete)."""
    request_id: str
    text: str
    token_id: int
    index: int  # 0-based output position
    logprob: tuple | None = None  # (token id, raw logprob, [(id, logprob)…]) when the caller asked (kvplay serve)


@dataclass
class RequestResult:
    request_id: str
    user: str
    text: str
    token_ids: list[int]
    stats: RequestStats
    finish_reason: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class RequestHandle:
    """What `Engine.submit` returns: iterate for TokenDeltas, or wait for the result."""

    def __init__(self, request_id: str, user: str, engine):
        self.request_id = request_id
        self.user = user
        self._engine = engine
        self._queue: "queue.Queue[TokenDelta | RequestResult]" = queue.Queue()
        self._result: RequestResult | None = None
        self._sink = None  # forward_to's callback
        self._sink_lock = threading.Lock()

    def _put(self, item) -> None:
        with self._sink_lock:
            if self._sink is None:
                self._queue.put(item)
                return
            sink = self._sink
        sink(item)

    def forward_to(self, sink) -> None:
        """Hand every TokenDelta and then the RequestResult to `sink(item)` instead of queueing
        them (what was queued already goes first). `sink` runs on the engine thread: it must be
        quick and never raise (kvplay serve posts to its event loop, so no thread per request)."""
        with self._sink_lock:
            while True:
                try:
                    sink(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._sink = sink

    def _get(self, deadline: float | None):
        """The next streamed item. Waits in short slices so that an engine whose thread is gone
        raises EngineError instead of leaving the caller blocked for ever."""
        while True:
            left = 0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic()))
            try:
                return self._queue.get(timeout=left)
            except queue.Empty:
                pass
            if not getattr(self._engine, "alive", True):
                try:  # the engine's last act is to finish every request: look once more
                    return self._queue.get_nowait()
                except queue.Empty:
                    raise EngineError(f"request {self.request_id}: the engine stopped before it finished") from None
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def __iter__(self) -> Iterator[TokenDelta]:
        while self._result is None:
            item = self._get(None)
            if isinstance(item, RequestResult):
                self._result = item
                return
            yield item

    def result(self, timeout: float | None = None) -> RequestResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            item = self._get(deadline)
            if item is None:
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
            if isinstance(item, RequestResult):
                self._result = item
        return self._result

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)


@dataclass(frozen=True)
class HashKeys:
    """What a request's block hashes are made under, fixed when it is admitted.

    `epoch` counts the cache generations (a hash, seed or determinism change starts a new one);
    `hasher` is the BlockHasher in force; `isolation` and `salt` decide its extra keys. A
    running request keeps its keys whatever `reconfigure` does; a preempted one drops them with
    its hashes and is re-admitted under the keys in force then.
    """
    epoch: int
    hasher: object
    isolation: str
    salt: tuple | None


@dataclass
class Request:
    request_id: str
    user: str
    group: str | None
    prompt_ids: list[int]
    sampling: SamplingParams
    system_tokens: int
    handle: RequestHandle | None
    generator: object
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks so far
    keys: HashKeys | None = None  # what `hashes` were made under (frozen at admission)
    collisions_seen: set = field(default_factory=set)  # (block index, hash) already reported
    num_computed: int = 0  # tokens whose K/V is in the pool
    high_water: int = 0  # most tokens ever computed (recompute accounting after preemption)
    registered: int = 0  # full blocks already registered in the prefix index
    status: str = WAITING
    admitted_once: bool = False
    start_time: float | None = None
    first_token_time: float | None = None
    text: str = ""  # the streamed text so far (output.py)
    detok: object = None  # output.Detokenizer: where incremental decoding stands
    logits_trace: list | None = None  # when set, the runner appends each step's logits (labs)
    stats: RequestStats = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.stats is None:
            self.stats = RequestStats(self.request_id, self.user, prompt_tokens=len(self.prompt_ids))

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens still to feed the model before the next sample (>= 1 while running)."""
        return self.num_tokens - self.num_computed
