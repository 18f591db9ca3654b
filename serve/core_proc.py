"""The engine-core process of `kvplay serve`: the engine and everything next to it
(serve/engine_side.py: the KV-event publisher, /metrics counters, the session recording), apart
from the HTTP process, as vLLM splits its API server from its EngineCore.

Why a process: every torch op drops and retakes the GIL, so in one process the engine thread
waited on the HTTP thread's Python (measured: ~10 % of the engine thread at 8 clients, and a
30 %-duty Python thread slowed a one-thread step 104 → 136 ms where a process did not). Here
the engine process runs only the engine, its listeners and this link's small threads.

Started by serve/core_client.py as ``python -m kvplay.serve.core_proc FD`` with one end of a
socketpair (serve/link.py). The protocol, in order:

- HTTP → core ``("start", CoreParams)``; core → HTTP ``("ready", info)`` or ``("fatal", line)``.
- ``("submit", Submit)`` → ``("accepted", rid)`` or ``("refused", rid, line)``; then the turn's
  TokenDeltas and RequestResult in ``("out", [items])``, one message per engine step.
- ``("cancel", rid)``; ``("call", cid, name, args)`` → ``("reply", cid, ok, value)`` for
  ``stats``, ``metrics_snapshot``, ``clear_cache``, ``register_user``.
- core → HTTP ``("beat", alive, failure)`` twice a second (what /health reports).
- ``("close",)`` or the end of the link: the core stops publishing, finishes the recording,
  closes the session and the engine, and exits.

Ctrl-C in a terminal reaches both processes: the core ignores SIGINT and stops when the HTTP
process tells it to (or dies: the link ends). SIGTERM stops it the same clean way.
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvplay.engine.errors import EngineError
from kvplay.sessions.headless import start_engine
from kvplay.sessions.recorder import Recorder, close_run
from kvplay.wire import curve as wire_curve

from .engine_side import EngineSide, event_publisher
from .link import Link, LinkClosed

BEAT_S = 0.5
CALLS = ("stats", "metrics_snapshot", "clear_cache", "register_user")


@dataclass
class CoreParams:
    """What the HTTP process decided (and checked) before starting the core."""
    config: object  # EngineConfig
    identities: list = field(default_factory=list)  # [(user, group)] of every API key
    kv_events: object | None = None  # wire.publisher.KVEventsConfig
    loopback: bool = True
    curve_dir: str | None = None
    report_full: bool = False
    db: str | None = None  # None: no recording
    record: bool = False
    title: str | None = None
    explain_across_keys: bool = False  # --explain-across-keys


def build_side(p: CoreParams):
    """(engine, recorder, side) for `p`; anything that fails is one line (EngineError)."""
    engine = start_engine(p.config)
    rec = side = None
    try:
        if p.record:
            rec = Recorder.open(p.db, p.config, engine.model_name, "serve", "", title=p.title)
        curve = None
        if p.curve_dir:
            curve = wire_curve.ServerCurve.load(p.curve_dir)
        side = EngineSide(engine, p.identities, event_publisher(p.kv_events, p.loopback, curve),
                          report_full=p.report_full, recorder=rec, explain_across_keys=p.explain_across_keys)
    except BaseException:
        close_run(rec, engine)
        raise
    return engine, rec, side


class Core:
    """The serving loop on the core's main thread; outputs go out from the engine thread."""

    def __init__(self, link: Link, side: EngineSide):
        self.link = link
        self.side = side
        self.engine = side.engine
        self._handles: dict = {}
        self._out: list = []
        self._out_lock = threading.Lock()
        self._calls = ThreadPoolExecutor(2, thread_name_prefix="kvplay-core-call")
        self._stop = threading.Event()
        self._unsub = self.engine.subscribe_batches(self._flush)  # at the end of every step
        self._beat = threading.Thread(target=self._beats, name="kvplay-core-beat", daemon=True)

    # --- the engine thread ---------------------------------------------------------------------
    def _sink(self, item) -> None:
        with self._out_lock:
            self._out.append(item)
        if not hasattr(item, "token_id"):
            self._handles.pop(item.request_id, None)

    def _flush(self, batch=None) -> None:
        """The step's outputs in one message (called with every step's event batch)."""
        if not self._out:
            return
        with self._out_lock:
            items, self._out = self._out, []
        try:
            self.link.send(("out", items))
        except LinkClosed:
            self._stop.set()

    # --- the main thread -----------------------------------------------------------------------
    def serve(self) -> None:
        self._beat.start()
        try:
            while not self._stop.is_set():
                try:
                    msg = self.link.recv()
                except LinkClosed:
                    return
                if not self._dispatch(msg):
                    return
        finally:
            self._stop.set()
            self._unsub()
            for h in list(self._handles.values()):  # the HTTP side is gone: free their blocks
                h.cancel()
            self._calls.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self, msg) -> bool:
        op = msg[0]
        if op == "submit":
            s = msg[1]
            try:
                h = self.side.submit(s)
            except EngineError as exc:
                self._send(("refused", s.request_id, str(exc)))
                return True
            self._handles[s.request_id] = h
            h.forward_to(self._sink)
            self._send(("accepted", s.request_id))
        elif op == "cancel":
            h = self._handles.get(msg[1])
            if h is not None:
                h.cancel()
        elif op == "call":
            _, cid, name, args = msg
            self._calls.submit(self._call, cid, name, args)
        elif op == "close":
            return False
        return True

    def _call(self, cid, name, args) -> None:
        if name not in CALLS:
            self._send(("reply", cid, False, f"no such call {name!r}"))
            return
        try:
            value = getattr(self.side, name)(*args)
        except Exception as exc:
            self._send(("reply", cid, False, str(exc) or type(exc).__name__))
            return
        self._send(("reply", cid, True, value))

    def _send(self, msg) -> None:
        try:
            self.link.send(msg)
        except LinkClosed:
            self._stop.set()

    def _beats(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._send(("beat", self.side.alive, getattr(self.engine, "failure", None)))


def _stop_on_sigterm(signum, frame):
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)

    link = Link(socket.socket(fileno=int(argv[0])))
    try:
        op, params = link.recv()
    except LinkClosed:
        return 1
    try:
        engine, rec, side = build_side(params)
    except Exception as exc:  # one line back to the HTTP process, which says it and exits 2
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        try:
            link.send(("fatal", line))
        except LinkClosed:  # the HTTP process is gone already
            pass
        return 2

    # the model, tokenizer and torch are built and never garbage: move them out of the collector's
    # reach (vLLM freezes the same way after start-up). A full collection over them takes ~0.2 s;
    # what this buys is measured at exit (SIGTERM to gone: ~2 s before, ~0.35 s after)
    gc.freeze()
    try:
        link.send(("ready", {
            "tokenizer": side.tokenizer, "model_name": side.model_name, "config": side.config,
            "max_positions": side.max_positions, "num_blocks": side.num_blocks,
            "events_info": side.events_info, "recording_info": side.recording_info}))
        Core(link, side).serve()
    except LinkClosed:
        pass
    except Exception:  # say it in the server's log; the HTTP side sees the link end
        traceback.print_exc()
        return 1
    finally:
        try:
            side.close()
        finally:
            close_run(rec, engine)
            link.close()
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except SystemExit as stop:  # SIGTERM to the core itself (a process-group kill): closed the same way
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)  # as sys.exit
    # everything is closed by now (session, publisher, engine): skip the interpreter's final
    # collection of the model's objects, measured at ~2 s idle and far longer on a loaded
    # machine, which the HTTP process (and a supervisor's SIGTERM) waits for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
