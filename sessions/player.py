"""Play turns through one Engine: `kvplay run` and headless replay.

The pacing and the conversations are sessions/conversation.py's (the app's panes use the same):
turns without `at` run in file order, each after the previous turn finished; turns with `at`
(seconds from the start, divided by `speed`) are submitted at that offset and run concurrently.
Either way a user's turn waits for that user's previous reply, and (unless the job carries
fixed `messages`) its prompt is the system prompt + that user's earlier turns and replies.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvplay.engine.errors import EngineError
from kvplay.engine.request import RequestResult
from kvplay.engine.sampling_params import SamplingParams

from .conversation import Conversation, Pacing, consume

TURN_TIMEOUT_S = 3600.0  # a turn still unfinished after this is reported as failed, never waited on for ever


@dataclass
class Job:
    turn: int  # 1-based position in the script / recording
    user: str
    text: str
    sampling: SamplingParams
    at: float | None = None
    messages: list[dict] | None = None  # fixed prompt (replay); None: build from the conversation
    group: str | None = None  # the user's group from this turn on ("" = none); None: unchanged
    clear: bool = False  # empty the cache before this turn (a recorded or scripted F4)
    engine: dict | None = None  # settings changed before this turn (after `clear`): F2/F3/F5
    prompt: tuple[list[int], int] | None = None  # (token ids, system tokens): a recorded prompt
    # that has no messages (a server's completion turn), sent as it was


@dataclass
class Done:
    job: Job
    messages: list[dict]
    result: RequestResult | None
    error: str | None
    started: float  # wall clock (time.time()) at submit
    ended: float
    offset: float = 0.0  # seconds from the start of play at submit
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    def record(self, recorder) -> None:
        """Write this finished turn to `recorder` (a sessions Recorder, or None); a turn the
        engine never answered (no result) is not recorded."""
        if recorder is not None and self.result is not None:
            recorder.record_turn(self.job.user, self.job.text, self.messages, self.job.sampling, self.result,
                                 at=self.job.at, started=self.started, prompt=self.job.prompt)


def play(engine, jobs: list[Job], system: str, on_done: Callable[[Done], None] | None = None,
         speed: float = 1.0) -> list[Done]:
    """Run every job; call `on_done` (serialised, in finish order); return Dones in job order."""
    if speed <= 0:
        raise EngineError(f"--speed must be positive (got {speed})")
    n = len(jobs)
    finished = [threading.Event() for _ in jobs]
    pacing = Pacing([(job.user, job.at) for job in jobs], speed)
    conversations: dict[str, Conversation] = {}
    out: list[Done | None] = [None] * n
    lock = threading.Lock()
    failures: list[BaseException] = []
    t0 = time.monotonic()

    def run(i: int) -> None:
        job = jobs[i]
        try:
            delay = t0 + pacing.due(i) - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            for p in pacing.after[i]:
                finished[p].wait()
            conversation = conversations.setdefault(job.user, Conversation())
            if job.messages is not None or job.prompt is not None:
                messages = job.messages or []
            else:
                messages = conversation.messages(system, job.text)
            started, offset = time.time(), time.monotonic() - t0
            try:
                # through the engine's queue, so each applies before this turn (and is recorded
                # there as an event, as the app's F2-F5 and group changes are)
                if job.clear:
                    engine.clear_cache()
                if job.engine:
                    engine.reconfigure(**job.engine)
                if job.group is not None:
                    engine.set_group(job.user, job.group or None)
                if job.prompt is not None:
                    handle = engine.submit(job.user, sampling=job.sampling, prompt_ids=job.prompt[0],
                                           system_tokens=job.prompt[1])
                else:
                    handle = engine.submit(job.user, messages, job.sampling)
                try:
                    res = consume(handle, timeout=TURN_TIMEOUT_S)
                except TimeoutError:
                    handle.cancel()
                    raise
                err = res.error
            except (EngineError, TimeoutError) as exc:  # a stopped engine or a stuck turn: an error row
                res, err = None, str(exc)
            done = Done(job, messages, res, err, started, time.time(), offset)
            if err is None:
                conversation.add(job.text, res.text)
            out[i] = done
            if on_done is not None:
                with lock:
                    on_done(done)
        except BaseException as exc:  # surfaced in the calling thread after join
            failures.append(exc)
        finally:
            finished[i].set()

    threads = [threading.Thread(target=run, args=(i,), name=f"kvplay-turn-{i + 1}", daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
    if failures:
        raise failures[0]
    return [d for d in out if d is not None]
