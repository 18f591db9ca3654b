"""A request (one user turn) as the scheduler sees it, its stats, and the client's handle."""
from __future__ import annotations

import queue
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

from .sampling import SamplingParams

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

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenDelta:
    """A piece of streamed text (may be empty while a multi-byte character is incomplete)."""
    request_id: str
    text: str
    token_id: int
    index: int  # 0-based output position


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

    def _put(self, item) -> None:
        self._queue.put(item)

    def __iter__(self) -> Iterator[TokenDelta]:
        while self._result is None:
            item = self._queue.get()
            if isinstance(item, RequestResult):
                self._result = item
                return
            yield item

    def result(self, timeout: float | None = None) -> RequestResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s") from None
            if isinstance(item, RequestResult):
                self._result = item
        return self._result

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)


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
    num_computed: int = 0  # tokens whose K/V is in the pool
    high_water: int = 0  # most tokens ever computed (recompute accounting after preemption)
    registered: int = 0  # full blocks already registered in the prefix index
    status: str = WAITING
    admitted_once: bool = False
    start_time: float | None = None
    first_token_time: float | None = None
    text: str = ""
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
