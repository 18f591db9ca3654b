"""The public Engine: one model, one block pool, one thread.

Clients (the app, ``kvplay run``, replay, labs, bench) call ``submit`` from any thread and get
a ``RequestHandle`` to iterate streamed ``TokenDelta``s or wait for the ``RequestResult``.
Everything that touches the model or the pool runs on the engine's own thread; other threads
talk to it through a command queue. Batch subscribers are called on the engine thread and must
be quick (the app's backend applies the batch to its mirror; the recorder enqueues it).

Identity is bound here (``register_user`` / ``set_group``, registry.py), never per request.
One step on the engine thread (``Engine.step``, as nano-vllm's ``LLMEngine.step`` and vLLM v1's
``EngineCore.step``): the scheduler decides (scheduler.py; its KV manager gives each request its
blocks: kv_manager.py over the block pool, pool.py + eviction.py), the model runner computes the
decision's rows (runner.py, paged.py, kv_store.py), the scheduler takes the logits back
(``update``: the output processor samples, detokenises and streams, output.py); then the stats
are published (observe.py) and the events the step queued are drained into one EngineBatch for
the batch subscribers (every cache view mirrors them: wire/mirror.py).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Callable

from .chat import encode_chat
from .config import RESTART_FIELDS, EngineConfig
from .errors import EngineError
from .events import EngineBatch, EventQueue, RequestQueued, SettingsChanged, UserGroupChanged
from .eviction import make_policy
from .heap import keep_freed_memory
from .kv_manager import KVManager
from .model import LoadedModel, load_model
from .observe import Observer
from .kv_store import KVStore
from .output import OutputProcessor
from .pool import BlockPool
from .prefix import BlockHasher
from .registry import UserRegistry, check_user
from .request import Request, RequestHandle
from .runner import ModelRunner, kv_geometry
from .sampling import make_generator
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .threads import on_fresh_thread, set_cpu_threads


def pool_blocks(loaded: LoadedModel, cfg: EngineConfig) -> int:
    """The pool's size in blocks: `num_blocks`, or as many blocks of `loaded`'s K/V as fit in
    `cache_mb` (the bench sizes its peers' caches with this too)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    layers, kv_heads, head_dim = kv_geometry(loaded.model)
    per_block = KVStore.bytes_per_block(cfg.block_size, layers, kv_heads, head_dim, loaded.dtype)
    n = int(cfg.cache_mb * 1024 * 1024 // per_block)
    if n < 1:
        raise EngineError(f"--cache-mb {cfg.cache_mb} is smaller than one block "
                          f"({per_block / 1024 / 1024:.2f} MB at block size {cfg.block_size})")
    return n


log = logging.getLogger(__name__)


def _new_id() -> str:
    return uuid.uuid4().hex[:12]


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 progress: Callable[[str], None] | None = None):
        self.config = (config or EngineConfig()).validate()
        kwargs = {"progress": progress} if progress else {}
        # The load and the runner's build run on a thread that ends (engine/threads.py): only
        # the engine thread keeps an OpenMP pool.
        self.loaded = loaded or on_fresh_thread(
            lambda: load_model(self.config.model, self.config.device, self.config.dtype, **kwargs))
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self._batch_listeners: list[Callable[[EngineBatch], None]] = []
        self.events = EventQueue()  # every part of the engine queues its events here (events.py)
        self._batches = 0
        self._cmds: "queue.Queue[tuple]" = queue.Queue()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False  # set (under _submit_lock) by shutdown: no command gets in after
        self._submit_lock = threading.Lock()
        self.users = UserRegistry()
        self._observer = Observer(self)  # the published stats (engine/observe.py)
        self.failure: str | None = None
        self.warmed_up = 0  # tokens of the engine thread's start-up forward (_warm_up)
        self._warm = threading.Event()  # set once the start-up forward is done (start() waits for it)
        keep_freed_memory()  # a step's activations stay in the heap for the next (heap.py)
        on_fresh_thread(self._build)

    # --- construction -------------------------------------------------------------------------
    def _build(self) -> None:
        cfg = self.config
        set_cpu_threads(cfg.threads)
        n = pool_blocks(self.loaded, self.config)
        self.hasher = BlockHasher(cfg.hash, cfg.block_size, cfg.hash_seed)
        emit = self.events.put
        self.pool = BlockPool(n, cfg.block_size, cfg.eviction, events=self.events, hex_fn=self.hasher.fn.hex)
        self.runner = ModelRunner(self.loaded, n, cfg.block_size, packed=cfg.packed_weights,
                                  cascade=cfg.cascade_attention, native=cfg.native_attention,
                                  fused=cfg.fused_ops)
        eos = self.loaded.model.generation_config.eos_token_id if self.loaded.model.generation_config else None
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.kv = KVManager(cfg, self.pool, self.hasher, self.model_name, emit, decode=self.tokenizer.decode)
        self.output = OutputProcessor(self.tokenizer, eos_ids, self.runner.max_positions, emit)
        self.scheduler = Scheduler(cfg, self.kv, self.output, emit)
        self._end_step()
        try:  # compile the chat template now, not on a user's first message (~0.7 s, holds the GIL)
            encode_chat(self.tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        except EngineError:
            pass

    # --- events -------------------------------------------------------------------------------
    def subscribe_batches(self, fn: Callable[[EngineBatch], None]) -> Callable[[], None]:
        """Call `fn(batch)` on the engine thread at the end of every step, command and call: the
        events the engine's parts queued meanwhile, in order (possibly none: the batch also says
        a step ended, e.g. for a server that sends a step's outputs at once). The one stream
        every cache view, the recorder, the KV-event publisher and the metrics read (wire/mirror.py
        mirrors it). Returns an unsubscribe.

        A request's result is handed to its waiter as the step produces it, before the step's
        batch goes out: `call(lambda: None)` returns once that batch has been handed over."""
        self._batch_listeners.append(fn)
        return lambda: self._batch_listeners.remove(fn) if fn in self._batch_listeners else None

    def _drain_events(self) -> None:
        """Take the events queued since the last drain and hand them to the batch subscribers
        as one batch (vLLM's ``take_events()``)."""
        events = self.events.take()
        if not self._batch_listeners:
            return
        self._batches += 1
        batch = EngineBatch(self._batches, time.time(), events, self.runner.forwards)
        for fn in list(self._batch_listeners):
            try:
                fn(batch)
            except Exception:  # a broken subscriber never stops the engine
                pass

    # --- thread -------------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Start the engine thread and return once it is ready: after its start-up forward
        (`_warm_up`), so a first request's TTFT is its own, not the warm-up's too."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvplay-engine", daemon=True)
            self._thread.start()
        thread = self._thread
        while not self._warm.wait(0.05) and thread.is_alive():
            pass
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread. Requests still queued or running finish with an error
        ("engine shut down"), so nobody waiting on a handle hangs.

        After the lock-guarded `_closed` flag is set no command can enter the queue (submit
        raises instead), and the engine thread itself, once its current step ends, fails
        everything still queued or running: the scheduler is never touched from two threads,
        even when the join below times out on a long step."""
        with self._submit_lock:
            self._closed = True
            self._stop.set()
            self._cmds.put(("noop",))
        thread = self._thread
        if thread is None:  # never started: nothing runs concurrently, drain here
            self._final_drain()
            return
        thread.join(timeout)
        if not thread.is_alive():
            self._thread = None
        # else: the thread is still in a step; it runs _final_drain itself when the step ends

    @property
    def alive(self) -> bool:
        """True while the engine thread runs (requests it holds will get a result)."""
        return self._thread is not None and self._thread.is_alive()

    def _final_drain(self) -> None:
        """Fail every request and command left at shutdown (on the engine thread, or on the
        caller's when the thread never started)."""
        with self._lock:
            while True:
                try:
                    op, *args = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if op == "submit":
                    self.take_in(args[0])
                elif args and isinstance(args[-1], Future) and not args[-1].done():
                    args[-1].set_exception(EngineError("engine shut down"))
            self.scheduler.fail_all("engine shut down")
            self._end_step()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _loop(self) -> None:
        set_cpu_threads(self.config.threads)  # libgomp reads the count per thread
        try:
            try:
                self._warm_up()
            finally:
                self._warm.set()
            while not self._stop.is_set():
                # Idle: sleep until a command arrives. Busy: take whatever is queued, then step.
                idle = not self.scheduler.has_work()
                while not self._stop.is_set():
                    try:
                        cmd = self._cmds.get(timeout=0.5) if idle else self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    self._run_cmd(cmd)
                    idle = False
                if self.scheduler.has_work() and not self._stop.is_set():
                    try:
                        with self._lock:
                            self.step()
                    except Exception as exc:  # model failure: fail in-flight requests, keep serving
                        self.failure = f"{type(exc).__name__}: {exc}"
                        with self._lock:
                            self.scheduler.fail_all(f"engine step failed: {self.failure}")
                            self._end_step()
        finally:
            self._final_drain()

    def _warm_up(self) -> None:
        """The engine thread's first work: one forward of a full first prompt chunk (the prefill
        budget's tokens, in the engine's mode) into the blocks the pool hands out first
        (runner.warm_up), on this thread, whose malloc arena and OpenMP pool every later step
        uses. `start()` returns once it is done (~1.2 s at one thread for the embedded model), so
        no request's TTFT holds it. The bench's cold TTFT of alice's 540-token prompt, median of 3
        at one thread: 602 -> 574 ms (2026-12-06, 2-core EPYC).
        `KVPLAY_WARM_UP=0` skips it."""
        if os.environ.get("KVPLAY_WARM_UP", "1") == "0":
            return
        rows = self.config.prefill_budget
        with self._lock:
            blocks = self.pool.free_ids()[:-(-rows // self.config.block_size)]
            try:
                self.warmed_up = self.runner.warm_up(blocks, rows, self.config.deterministic)
            except Exception as exc:  # noqa: BLE001 - steps report their own failures; this one only costs time
                log.warning("start-up forward failed: %s: %s", type(exc).__name__, exc)

    def step(self) -> bool:
        """One engine step (on the engine thread, under its lock; tests without a thread call it
        themselves): the scheduler decides, the model runs the decision, the scheduler takes the
        logits back; then the step's events go out as one batch. True if the model ran."""
        decision = self.scheduler.schedule()
        if decision:  # decode rows and prompt chunks in one forward: the weights are read once a step
            logits = self.runner.forward(decision.rows(), self.config.deterministic)
            self.scheduler.update(decision, logits)
        self._end_step()
        return bool(decision)

    def _run_cmd(self, cmd: tuple) -> None:
        op, *args = cmd
        if op == "noop":
            return
        fut: Future | None = args[-1] if args and isinstance(args[-1], Future) else None
        try:
            with self._lock:
                if op == "submit":
                    self.take_in(args[0])
                    out = None
                elif op == "cancel":
                    out = self.scheduler.cancel(args[0])
                elif op == "call":
                    out = args[0]()
                else:  # pragma: no cover
                    raise ValueError(op)
                self._end_step()
            if fut is not None:
                fut.set_result(out)
        except Exception as exc:
            if fut is not None:
                fut.set_exception(exc)

    def _post(self, fn: Callable[[], object]) -> Future:
        """Queue `fn` to run on the engine thread between steps, in order with submits. Without
        an engine thread (not started, or gone after shutdown) it runs here and now."""
        fut: Future = Future()
        if threading.current_thread() is self._thread or not self.alive:
            with self._lock:
                try:
                    fut.set_result(fn())
                except Exception as exc:
                    fut.set_exception(exc)
                self._end_step()
            return fut
        with self._submit_lock:
            if self._closed:
                raise EngineError("engine shut down")
            self._cmds.put(("call", fn, fut))
        return fut

    def call(self, fn: Callable[[], object], timeout: float | None = 60.0):
        """Run `fn` on the engine thread between steps and return its result."""
        return self._post(fn).result(timeout)

    # --- client API ---------------------------------------------------------------------------
    def encode(self, messages: list[dict]) -> tuple[list[int], int]:
        return encode_chat(self.tokenizer, messages)

    def register_user(self, name: str, group: str | None = None) -> None:
        """Bind `name` to `group` (see registry.py). Idempotent when unchanged; a different
        group for a known user is an EngineError (use `set_group`)."""
        self.users.register(name, group)

    def set_group(self, name: str, group: str | None) -> None:
        """Move `name` to `group` (None: no group). Requests submitted afterwards use it (the
        change travels the engine's command queue with them); a `UserGroupChanged` event
        records it."""
        check_user(name, group)

        def apply():  # on the engine thread, in order with submits: the event is where it applies
            old = self.users.set_group(name, group)
            if old != group:
                self.events.put(UserGroupChanged(user=name, old_group=old, new_group=group))
        self._post(apply)  # does not wait: submits queued after this one see the new group

    def submit(self, user: str, messages: list[dict] | None = None, sampling: SamplingParams | None = None,
               prompt_ids: list[int] | None = None, system_tokens: int = 0,
               request_id: str | None = None, trace_logits: bool = False) -> RequestHandle:
        """Queue one turn for `user` (its group comes from the user registry when the engine
        thread takes it in). Raises EngineError (one clear line) for bad input or after
        shutdown; once this returns, the handle always gets a result."""
        req = self.make_request(user, messages, sampling, prompt_ids, system_tokens, request_id, trace_logits)
        with self._submit_lock:  # the check and the put are one step: shutdown cannot slip between
            if self._closed:
                raise EngineError("engine shut down")
            if self._thread is None:
                raise EngineError("engine is not started (use Engine(...).start() or `with Engine(...)`)")
            self._cmds.put(("submit", req))  # never blocks: the engine thread takes it between steps
        return req.handle

    def make_request(self, user: str, messages: list[dict] | None = None, sampling: SamplingParams | None = None,
                     prompt_ids: list[int] | None = None, system_tokens: int = 0,
                     request_id: str | None = None, trace_logits: bool = False) -> Request:
        """Validate one turn and build its Request (with a handle) without queueing it.
        `submit` queues it; tests that drive `step()` themselves use `take_in`."""
        sampling = (sampling or SamplingParams()).validate()
        if not user or not str(user).strip():
            raise EngineError("a request needs a user name")
        if prompt_ids is None:
            if messages is None:
                raise EngineError("submit needs messages or prompt_ids")
            prompt_ids, system_tokens = self.encode(messages)
        if not prompt_ids:
            raise EngineError("empty message")
        n = len(prompt_ids)
        limit = self.runner.max_positions
        if n >= limit:
            raise EngineError(f"message is {n} tokens; the model's context is {limit}")
        need = -(-(n + 1) // self.config.block_size)
        if need > self.pool.num_blocks:
            raise EngineError(f"message is {n} tokens ({need} blocks of {self.config.block_size}); "
                              f"{self.config.pool_size_hint(self.pool.num_blocks)}")
        rid = request_id or _new_id()
        seed = sampling.seed if sampling.seed is not None else int(uuid.UUID(int=uuid.uuid4().int).int & 0xFFFFFFFF)
        handle = RequestHandle(rid, user, self)
        req = Request(rid, user, None, list(prompt_ids), sampling, system_tokens, handle, make_generator(seed))
        req.stats.seed = seed
        if trace_logits:
            req.logits_trace = []
        handle.request = req  # read-only access for labs (logits trace, stats)
        return req

    def take_in(self, req: Request) -> None:
        """Hand `req` to the scheduler (engine thread, or the caller's when no thread runs):
        its group is read from the registry now."""
        req.group = self.users.group_of(req.user)  # identity: the registry, at take-in
        self.scheduler.add(req)
        self.events.put(RequestQueued(request_id=req.request_id, user=req.user, prompt_tokens=len(req.prompt_ids)))

    def generate(self, user: str, messages: list[dict], sampling: SamplingParams | None = None,
                 timeout: float | None = None):
        """Submit and wait: returns the RequestResult."""
        return self.submit(user, messages, sampling).result(timeout)

    def cancel(self, request_id: str) -> None:
        self._cmds.put(("cancel", request_id))

    # --- control ------------------------------------------------------------------------------
    def clear_cache(self) -> int:
        """Drop every cached block (blocks in use by running requests keep serving them); the
        pool emits `AllBlocksCleared(reason="cleared")` on the engine thread, where it applies."""
        return self.call(lambda: self.pool.clear("cleared"))

    def set_miss_attribution(self, on: bool) -> None:
        """Explain why each miss was computed (engine/miss.py) or not, from the next admission on
        (on by default; the bench measures what it costs)."""
        self.call(lambda: self.kv.set_attribution(on))

    @property
    def miss_across_keys(self) -> bool:
        """Whether misses are explained from other keys' blocks too (`set_miss_across_keys`)."""
        return self.kv.across_keys

    def set_miss_across_keys(self, on: bool) -> None:
        """Explain a salted request's miss from other salts' blocks too (isolated, config by
        content: the default) or from its own keys' only: that lookup's time on the request's
        path tells the sender whether another key cached the same prompt (docs/miss.md, "Across
        keys"). `kvplay serve` with keys turns it off unless --explain-across-keys."""
        self.call(lambda: setattr(self.kv, "across_keys", bool(on)))

    def needs_fresh_cache(self, **changes) -> bool:
        """Would these config changes invalidate what is cached? (hash, seed, determinism)."""
        return any(k in changes and changes[k] != getattr(self.config, k)
                   for k in ("hash", "hash_seed", "deterministic"))

    def reconfigure(self, **changes) -> EngineConfig:
        """Change isolation / eviction / determinism / hashing / verify-on-hit at run time; a
        `SettingsChanged` event (the fields that changed) records it on the engine thread.

        Hash, seed or determinism changes clear the cache first (old blocks would be unreachable
        or not bitwise-compatible). Block size and model need a new Engine.
        """
        for k in RESTART_FIELDS:
            if k in changes and changes[k] != getattr(self.config, k):
                raise EngineError(f"changing {k} needs a new engine (restart with --{k.replace('_', '-')})")
        self.config.replace(**changes).validate()  # bad values fail here, on the caller's thread

        def apply():  # on the engine thread: applies only `changes` to the config as it is now
            clear = self.needs_fresh_cache(**changes)
            previous = {k: getattr(self.config, k) for k in changes}
            changed = {k: v for k, v in changes.items() if v != previous[k]}
            if changed:  # recorded where it applies, in order with the requests around it
                self.events.put(SettingsChanged(changes=changed, previous={k: previous[k] for k in changed}))
            for k, v in changes.items():
                setattr(self.config, k, v)
            if "eviction" in changes:
                self.pool.set_policy(make_policy(self.config.eviction))
            if clear:  # a new cache generation: running requests' later blocks stay unindexed
                self.hasher = BlockHasher(self.config.hash, self.config.block_size, self.config.hash_seed)
                self.kv.new_generation(self.hasher)
                self.pool.hex = self.hasher.fn.hex
                self.pool.clear("reconfigured")
            # waiting requests pick up a new isolation (or hasher) at their next admission
            # attempt; running ones keep the keys they were admitted with (scheduler.py)
            return self.config

        return self.call(apply)

    # --- observation (engine/observe.py) ---------------------------------------------------------
    def _end_step(self) -> None:
        """After each step or command (engine thread, under the lock): refresh the published
        stats and hand over the step's event batch."""
        self._observer.publish()
        self._drain_events()

    @property
    def num_blocks(self) -> int:
        """The pool's size in blocks (fixed for the engine's life)."""
        return self.pool.num_blocks

    @property
    def max_positions(self) -> int:
        """The model's context length in tokens."""
        return self.runner.max_positions

    @property
    def forwards(self) -> int:
        """Model forwards so far (the step clock every EngineBatch carries)."""
        return self.runner.forwards

    def decode_attention(self) -> str:
        """Which decode-attention path the model's steps take, in words (runner.py)."""
        return self.runner.decode_attention(self.config.deterministic)

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V one block holds (fixed for the engine's life)."""
        return self.runner.store.block_bytes

    def stats(self, timeout: float = 1.0) -> dict:
        """Global counters, O(1), consistent (taken between steps). If the engine is busy in a
        step for longer than `timeout` seconds, returns the copy published after the last step."""
        return self._observer.stats(timeout)
