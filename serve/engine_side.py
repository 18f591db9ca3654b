"""Everything `kvplay serve` runs next to the engine: admission of a turn into the engine, the
KV-event publisher, the /metrics counters and the session recording.

`EngineSide` is the one owner of these. The HTTP front end (serve/app.py) talks to it through
a small interface, the same whether the side lives in the server's own process (tests,
scripts: `build_state`) or in the engine-core process `kvplay serve` starts
(serve/core_proc.py, reached through serve/core_client.py's `RemoteSide`):

- static facts: ``tokenizer``, ``model_name``, ``config``, ``max_positions``, ``num_blocks``,
  ``events_info`` (the publisher's endpoints and settings, or None), ``recording_info``;
- ``submit(Submit) -> handle`` (``forward_to(sink)``, ``cancel()``), EngineError when refused;
- ``stats(timeout)``, ``metrics_snapshot()``, ``clear_cache()``, ``register_user()``, ``alive``,
  ``close()``.

The user a turn runs as is the one the front end authenticated (a key's identity, or the body's
name on a keyless loopback server); the side never reads a request body.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvplay.engine.errors import EngineError
from kvplay.engine.sampling_params import SamplingParams
from kvplay.wire.publisher import ZmqEventPublisher

from .kv_events import EngineEventPublisher
from .metrics import ServerMetrics
from .recording import ServeRecording

MAX_TOP_LOGPROBS = 20


@dataclass
class Submit:
    """One turn as the front end admits it (picklable: it crosses to the engine-core process)."""
    user: str
    group: str | None
    request_id: str
    prompt_ids: list[int]
    system_tokens: int
    sampling: SamplingParams
    top_logprobs: int | None = None  # None: no logprobs; else the raw logprob and this many best
    report_mode: str | None = None  # kv_cache_report_mode (None: the server's default)
    text: str = ""  # what the recording keeps as the turn's text
    messages: list = field(default_factory=list)
    started: float = 0.0


def logprob_entry(trace: list, index: int, token_id: int, top: int) -> tuple:
    """(token id, raw logprob, [(id, logprob)…]) of output token `index` from the logits the
    engine traced for it (vLLM's default: raw logprobs, before temperature/top-k/top-p). The
    traced row is dropped once read: a long logprobs reply does not keep every step's logits."""
    row, trace[index] = trace[index], None
    lp = torch.log_softmax(row.float(), dim=-1)
    best = []
    if top:
        vals, ids = torch.topk(lp, min(top, lp.shape[-1]))
        best = list(zip(ids.tolist(), vals.tolist()))
    return token_id, float(lp[token_id]), best


class SideHandle:
    """A turn's engine handle, seen from the front end: deltas carry their logprob entry when
    asked, and the result is queued for recording before the front end gets it."""

    def __init__(self, handle, top: int | None, on_result=None):
        self.handle = handle
        self.request_id = handle.request_id
        self.top = top
        self.on_result = on_result

    def forward_to(self, sink) -> None:
        def relay(item) -> None:  # on the engine thread
            if hasattr(item, "token_id"):
                if self.top is not None:
                    try:
                        item.logprob = logprob_entry(self.handle.request.logits_trace, item.index, item.token_id,
                                                     self.top)
                    except Exception:  # never fail the engine thread for one reply's logprobs
                        item.logprob = (item.token_id, float("nan"), [])
            elif self.on_result is not None:
                self.on_result(item)
            sink(item)

        self.handle.forward_to(relay)

    def cancel(self) -> None:
        self.handle.cancel()


def event_publisher(kv_events, loopback: bool, curve=None):
    """The ZMQ publisher of vLLM's KV events for a KVEventsConfig (None when events are off). On a
    loopback-only server a wildcard bind binds 127.0.0.1; `curve`: a wire.curve.ServerCurve."""
    if kv_events is None or not kv_events.enabled:
        return None

    return ZmqEventPublisher.from_config(kv_events, loopback=loopback, curve=curve)


class EngineSide:
    """The serving parts that live with one started Engine (see the module doc)."""

    def __init__(self, engine, identities=(), kv_publisher=None, report_full: bool = False, recorder=None,
                 explain_across_keys: bool = False):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.config = engine.config
        self.max_positions = engine.max_positions
        self.num_blocks = engine.num_blocks
        self.recording = ServeRecording(recorder) if recorder is not None else None
        self.recording_info = (None if recorder is None
                               else {"session_id": recorder.session_id, "path": str(recorder.path)})
        for user, group in identities:  # every key's identity is bound before serving
            self.register_user(user, group)
        if identities and not explain_across_keys:
            # tenants: a miss is explained from the sender's own keys only (the lookup across
            # keys takes longer the further another tenant's identical prefix goes, a time
            # channel through isolation; docs/miss.md, "Across keys")
            engine.set_miss_across_keys(False)
        self.metrics = ServerMetrics(engine)
        self.events = (EngineEventPublisher(engine, kv_publisher, report_full=report_full)
                       if kv_publisher is not None else None)
        if recorder is not None:
            recorder.attach(engine)

    @property
    def events_info(self) -> dict | None:
        if self.events is None:
            return None
        pub = self.events.publisher
        return {"endpoint": pub.endpoint, "binds": pub.binds, "replay_endpoint": pub.replay_endpoint,
                "settings": dict(pub.settings)}

    @property
    def alive(self) -> bool:
        return bool(getattr(self.engine, "alive", True)) and not getattr(self.engine, "_closed", False)

    def register_user(self, user: str, group: str | None) -> None:
        self.engine.register_user(user, group)
        if self.recording is not None:
            self.recording.note_user(user, group, wait=True)

    def submit(self, s: Submit) -> SideHandle:
        if s.top_logprobs is not None and not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
            raise EngineError(f"top_logprobs must be 0..{MAX_TOP_LOGPROBS}")
        on_result = None
        if self.recording is not None:
            self.recording.note_user(s.user, s.group)
            on_result = self.recording.turn(s.user, s.text, s.messages, s.sampling,
                                            (list(s.prompt_ids), s.system_tokens), s.started)
        if self.events is not None:
            self.events.set_mode(s.request_id, s.report_mode)
        try:
            handle = self.engine.submit(s.user, prompt_ids=s.prompt_ids, sampling=s.sampling,
                                        system_tokens=s.system_tokens, request_id=s.request_id,
                                        trace_logits=s.top_logprobs is not None)
        except EngineError:
            if self.events is not None:
                self.events.forget(s.request_id)
            raise
        return SideHandle(handle, s.top_logprobs, on_result)

    async def asubmit(self, s: Submit) -> SideHandle:
        return self.submit(s)

    def stats(self, timeout: float = 0.2) -> dict:
        return self.engine.stats(timeout)

    def metrics_snapshot(self) -> dict:
        return self.metrics.snapshot()

    def clear_cache(self) -> int:
        return self.engine.clear_cache()

    def close(self) -> None:
        """Stop publishing and counting, and finish the recording's queued writes (the engine
        and the recorder are closed by whoever opened them)."""
        if self.events is not None:
            self.events.close()
            self.events.publisher.shutdown()
        self.metrics.close()
        if self.recording is not None:
            self.recording.close()
