"""The OpenAI-compatible HTTP API over one Engine (FastAPI/Starlette, served by uvicorn). The
routes reach the engine only through its side (serve/engine_side.py): in this process, or in
`kvplay serve`'s engine-core process (serve/core_proc.py).

Routes: POST /v1/chat/completions, POST /v1/completions (streaming SSE or not), GET /v1/models,
GET /health, POST /reset_prefix_cache, GET /metrics, POST /tokenize; and (serve/info_routes.py)
GET /kv_event_sources, GET /server_info, POST /detokenize.

Who is asking comes from the bearer token (serve/keys.py) when the server has API keys, else
from the body's `user` (a loopback playground, shared isolation only). Every response carries
``usage.prompt_tokens_details.cached_tokens`` and a ``kvplay`` object (``cached_from``: the
users whose blocks the prompt reused, in tokens; with ``"return_miss_details": true`` in the
body also ``miss``, why the other prompt tokens were computed: in full for an admin key or a
server without keys, else as `engine.miss.redact` leaves it for the key's own user, since
another tenant's name, text, or the mere fact that another tenant holds the same tokens, is
what isolation hides). Errors are OpenAI-style JSON with the right status; a client that goes
away mid-request has its request cancelled (blocks freed) at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvplay.engine.chat import encode_chat
from kvplay.engine.errors import EngineError
from kvplay.engine.miss import redact
from kvplay.engine.sampling_params import SamplingParams

from .bridge import HandleStream
from .engine_side import Submit
from .info_routes import add_info_routes
from .keys import Identity, lookup
from .limits import Admission, TokenizerPool, check_prompt_size
from .metrics import render as render_metrics
from .protocol import ApiError, GenRequest, StopMatcher, bad, check_body, parse

MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this (a slow sender holds nothing longer)
MAX_CONCURRENT = 256  # generation requests in flight (a stream counts until it ends)
ANONYMOUS = "anonymous"


@dataclass
class ServeState:
    """Everything the routes share. Built by serve/server.py around the engine's side: an
    in-process EngineSide (tests, scripts) or the engine-core process's RemoteSide (`kvplay
    serve`); both offer the interface serve/engine_side.py describes."""
    side: object
    keys: dict[str, Identity] | None = None
    served_name: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    max_concurrent: int = MAX_CONCURRENT
    metrics_users: bool = False  # /metrics user labels for every caller (else: admin keys, or no keys)
    admission: Admission | None = None
    # copies of the tokenizer, one per thread at a time: HF fast tokenizers can fail with
    # "Already borrowed" when two threads use one; a long prompt never blocks the others
    tokenizers: TokenizerPool | None = None

    def __post_init__(self):
        self.admission = Admission(self.max_concurrent)
        self.tokenizers = TokenizerPool(self.side.tokenizer)

    @property
    def model_name(self) -> str:
        return self.served_name or self.side.model_name

    def model_names(self) -> set[str]:
        return {self.model_name, self.side.model_name, self.side.config.model}


# --- helpers ----------------------------------------------------------------------------------
def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def identify(state: ServeState, request: Request) -> Identity | None:
    """The key's identity; None when the server has no keys (the body names the user)."""
    if state.keys is None:
        return None
    header = request.headers.get("authorization")
    ident = lookup(state.keys, header)
    if ident is None:
        msg = ("missing API key: send 'Authorization: Bearer KEY'" if not header
               else "invalid API key")
        raise ApiError(401, msg, code="invalid_api_key")
    return ident


async def read_json(request: Request):
    size = request.headers.get("content-length")
    if size and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES >> 20} MiB", code="request_too_large")
    raw = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_BODY_BYTES:
                    raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES >> 20} MiB",
                                   code="request_too_large")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", code="timeout") from None
    if not raw.strip():
        raise bad("the request body is empty: send a JSON object")
    try:
        body = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"malformed JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad("the request body is nested too deeply", code="invalid_json") from None
    check_body(body)
    return body


def check_model(state: ServeState, model: str | None) -> None:
    if model is not None and model not in state.model_names():
        raise ApiError(404, f"The model `{model}` does not exist (this server serves `{state.model_name}`).",
                       "model", "model_not_found")


def prepare_prompt(state: ServeState, g: GenRequest) -> tuple[list[int], int]:
    """Token ids and system-prompt length (runs in a worker thread: tokenising is CPU work)."""
    side = state.side
    if g.prompt_ids is not None:
        vocab = len(side.tokenizer)
        for t in g.prompt_ids:
            if not 0 <= t < vocab:
                raise bad(f"token id {t} is outside the vocabulary (0..{vocab - 1})", "prompt")
        return list(g.prompt_ids), 0
    check_prompt_size(g, side.max_positions)
    if g.kind == "chat":
        try:
            return state.tokenizers.run(encode_chat, g.messages)
        except EngineError as exc:
            raise bad(str(exc), "messages") from None
    return state.tokenizers.run(lambda tok, text: (list(tok(text)["input_ids"]), 0), g.prompt)


def check_limits(state: ServeState, g: GenRequest, n: int) -> int:
    """Refuse prompts that can never run; return the max_tokens to use."""
    side = state.side
    param = "messages" if g.kind == "chat" else "prompt"
    if n == 0:
        raise bad("the prompt is empty after tokenisation", param)
    ctx = side.max_positions
    if n >= ctx:
        raise bad(f"This model's maximum context length is {ctx} tokens. However, your request has {n} "
                  f"input tokens. Please reduce the length of the input.", param, "context_length_exceeded")
    room = ctx - n
    if g.max_tokens is not None and g.max_tokens > room:
        raise bad(f"'max_tokens' is too large: {g.max_tokens}. This model's maximum context length is {ctx} "
                  f"tokens and your request has {n} input tokens ({g.max_tokens} > {ctx} - {n}).", "max_tokens")
    bs, total = side.config.block_size, side.num_blocks
    need = -(-(n + 1) // bs)
    if need > total:
        raise ApiError(413, f"the prompt is {n} tokens ({need} blocks of {bs}); this server's whole KV pool "
                            f"holds {total} blocks", param, "kv_pool_exceeded")
    return room if g.max_tokens is None else g.max_tokens


def finish_reason(result, stopped: bool) -> str:
    r = result.finish_reason
    if stopped:
        return "stop"
    if r in ("stop", "length"):
        return r
    if r == "pool_exhausted":
        return "length"
    return "abort"


def usage_of(*results) -> dict:
    """OpenAI usage of one request's choices: the prompt once (as the first choice computed or
    reused it), the completion tokens of every choice."""
    st = results[0].stats
    out = sum(r.stats.output_tokens for r in results)
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": out, "total_tokens": st.prompt_tokens + out,
            "prompt_tokens_details": {"cached_tokens": st.cached_tokens}}


def kvplay_of_all(turns: list, user: str) -> dict:
    """The kvplay extension for a response: one request's details, or with n > 1 the first
    choice's at the top level and every choice's under `choices`."""
    view = turns[0].miss_view
    out = kvplay_of(turns[0].result, user, view)
    if len(turns) > 1:
        out["choices"] = [kvplay_of(t.result, user, view) for t in turns]
    return out


def miss_view(g: GenRequest, ident: Identity | None) -> str | None:
    """What the sender of `g` may see of its miss object: None (not asked for), "full" (an admin
    key, or a server without keys: one machine, no tenants) or "own" (`engine.miss.redact`)."""
    if not g.miss_details:
        return None
    return "full" if ident is None or ident.admin else "own"


def kvplay_of(result, user: str, view: str | None = None) -> dict:
    st = result.stats
    out = {"request_id": result.request_id, "user": user, "cached_tokens": st.cached_tokens,
           "cached_from": dict(st.cached_from), "computed_tokens": st.computed_tokens,
           "finish_reason": result.finish_reason, "ttft_ms": st.ttft_ms, "queued_ms": st.queued_ms,
           "preemptions": st.preemptions}
    if view is not None:
        out["miss"] = st.miss if view == "full" else redact(st.miss, user)
    return out


UNAVAILABLE = ("shut down", "not started", "did not answer", "does not answer")


def engine_unavailable(err: str) -> bool:
    """The engine (its thread, or its engine-core process) is gone or not answering: a 503, not
    the request's fault."""
    return any(s in err for s in UNAVAILABLE)


def engine_failure(result) -> ApiError:
    err = result.error or "request failed"
    if "pool" in err and "block" in err:
        return ApiError(413, err, code="kv_pool_exceeded")
    if engine_unavailable(err):
        return ApiError(503, err, code="unavailable")
    return ApiError(500, err, code="engine_error")


def format_logprobs(tokenizer, entries: list, kind: str) -> dict:
    def text(tid):
        return tokenizer.decode([tid])

    if kind == "chat":
        return {"content": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                             "top_logprobs": [{"token": text(i), "logprob": v, "bytes": list(text(i).encode())}
                                              for i, v in best]} for t, lp, best in entries]}
    tokens = [text(t) for t, _, _ in entries]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(i): v for i, v in best} for _, _, best in entries], "text_offset": offsets}


class Turn:
    """One accepted request on its way through the engine."""

    def __init__(self, state: ServeState, g: GenRequest, user: str, rid: str, sampling: SamplingParams,
                 stream: HandleStream, index: int = 0, rid_base: str | None = None, miss_view: str | None = None):
        self.state, self.g, self.user, self.rid, self.sampling, self.stream = state, g, user, rid, sampling, stream
        self.miss_view = miss_view  # see miss_view()
        self.index = index  # the choice this request answers (n > 1)
        self.result = None
        self.matcher = StopMatcher(g.stop)
        self.logprobs: list = []  # (token id, logprob, [(id, logprob)…]) per token, when asked for
        self._lp_sent = 0
        self.created = int(time.time())
        self.id = ("chatcmpl-" if g.kind == "chat" else "cmpl-") + (rid_base or rid)

    async def pieces(self, request: Request | None = None):
        """Yield released text; ends with self.result set. Cancels the request if abandoned."""
        checked = time.monotonic()
        try:
            while True:
                try:
                    item = await self.stream.next(timeout=None if request is None else 0.5)
                except asyncio.TimeoutError:
                    item = None
                if request is not None and time.monotonic() - checked >= 0.5:  # tokens may never pause
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
                if not hasattr(item, "token_id"):
                    self.result = item
                    break
                if self.g.logprobs and not self.matcher.stopped and item.logprob is not None:
                    self.logprobs.append(item.logprob)
                piece = self.matcher.feed(item.text)
                if piece:
                    yield piece
                if self.matcher.stopped:
                    self.stream.cancel()
            if self.result.error is None:
                tail = self.matcher.finish()
                if tail:
                    yield tail
        finally:
            if self.result is None:
                self.stream.cancel()

    @property
    def finish(self) -> str:
        return finish_reason(self.result, self.matcher.stopped)

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if self.g.kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": self.index, "delta": delta, "logprobs": self._new_logprobs(), "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": self.index, "text": text or "", "logprobs": self._new_logprobs(), "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name,
                "choices": [choice]}

    def _new_logprobs(self, everything: bool = False):
        """The logprobs of the tokens not sent yet, in the chat or the completions shape."""
        if not self.g.logprobs:
            return None
        start = 0 if everything else self._lp_sent
        entries, self._lp_sent = self.logprobs[start:], len(self.logprobs)
        return format_logprobs(self.state.side.tokenizer, entries, self.g.kind)

    def full_choice(self) -> dict:
        """This choice in a non-streamed response."""
        text = self.matcher.released
        if self.g.kind == "chat":
            return {"index": self.index, "message": {"role": "assistant", "content": text},
                    "logprobs": self._new_logprobs(True), "finish_reason": self.finish}
        return {"index": self.index, "text": text, "logprobs": self._new_logprobs(True), "finish_reason": self.finish}


def full_response(turns: list[Turn]) -> dict:
    """The non-streamed response to one request: its choices' Turns, in index order."""
    first = turns[0]
    return {"id": first.id, "object": "chat.completion" if first.g.kind == "chat" else "text_completion",
            "created": first.created, "model": first.state.model_name,
            "choices": [t.full_choice() for t in turns], "usage": usage_of(*(t.result for t in turns)),
            "kvplay": kvplay_of_all(turns, first.user)}


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


async def _merged(turns: list):
    """(turn, piece) from every choice's stream as they come; (turn, None) when one ends."""
    if len(turns) == 1:
        async for piece in turns[0].pieces():
            yield turns[0], piece
        yield turns[0], None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(t):
        try:
            async for piece in t.pieces():
                await queue.put((t, piece))
        finally:
            await queue.put((t, None))

    tasks = [asyncio.create_task(pump(t)) for t in turns]
    try:
        for _ in range(len(turns)):
            while True:
                item = await queue.get()
                yield item
                if item[1] is None:
                    break
    finally:
        for task in tasks:
            task.cancel()


async def stream_turn(turns: list[Turn], slot=None):
    """SSE for one request: its choices' chunks interleaved as they come (each with its index),
    each choice's final chunk with its finish reason, then usage over all of them. `slot`
    (limits.Slot) is released when the stream ends."""
    turn = turns[0]
    try:
        if turn.g.kind == "chat":
            for t in turns:
                yield sse(t.chunk("", role=True))
        async for t, piece in _merged(turns):
            if piece is not None:
                yield sse(t.chunk(piece))
                continue
            res = t.result
            if res is None:  # cancelled under us (the client left)
                return
            if res.error is not None:
                yield sse(engine_failure(res).body())
                yield "data: [DONE]\n\n"
                return
            final = t.chunk(None if t.g.kind == "chat" else "", finish=t.finish)
            final["kvplay"] = kvplay_of(res, t.user, t.miss_view)
            yield sse(final)
        if turn.g.include_usage:
            yield sse({"id": turn.id, "object": "chat.completion.chunk" if turn.g.kind == "chat" else "text_completion",
                       "created": turn.created, "model": turn.state.model_name, "choices": [],
                       "usage": usage_of(*(t.result for t in turns)), "kvplay": kvplay_of_all(turns, turn.user)})
        yield "data: [DONE]\n\n"
    finally:
        for t in turns:
            if t.result is None:
                t.stream.cancel()
        if slot is not None:
            slot.release()


# --- the app ----------------------------------------------------------------------------------
def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="kvplay serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvplay = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(ApiError(exc.status_code, msg))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(bad(str(exc.errors()[0].get("msg", "invalid request")) if exc.errors() else "invalid request"))

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):  # the engine (or its process) is gone
        down = engine_unavailable(str(exc))
        return error_response(ApiError(503 if down else 500, str(exc), code="unavailable" if down else "engine_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # the text stays in the server's log
        print(f"kvplay serve: internal error on {request.method} {request.url.path}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return error_response(ApiError(500, "internal error (details are in the server's log)", code="internal_error"))

    async def generate(request: Request, kind: str):
        ident = identify(state, request)
        slot = state.admission.enter()  # before the body is read: a full server costs nothing more
        try:
            resp = await _generate(request, kind, ident, slot)
        except BaseException:
            slot.release()
            raise
        if not isinstance(resp, StreamingResponse):  # a stream releases its slot when it ends
            slot.release()
        return resp

    async def _generate(request: Request, kind: str, ident, slot):
        g = parse(await read_json(request), kind)
        check_model(state, g.model)
        user, group = (ident.user, ident.group) if ident is not None else (g.body_user or ANONYMOUS, None)
        prompt_ids, system_tokens = await run_in_threadpool(prepare_prompt, state, g)
        max_tokens = check_limits(state, g, len(prompt_ids))
        sampling = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_tokens=max_tokens,
                                  seed=g.seed, stop_on_eos=not g.ignore_eos)
        rid = uuid.uuid4().hex[:16]
        side = state.side
        # what the recording keeps of the turn (nothing crosses to a side that does not record)
        records = side.recording_info is not None
        text = (g.messages[-1]["content"] if g.kind == "chat" else g.prompt or "") if records else ""
        messages = g.messages if records and g.kind == "chat" else []
        turns: list[Turn] = []
        for i in range(g.n):  # n choices: n requests for the prompt (the later ones reuse its blocks)
            rid_i = rid if g.n == 1 else f"{rid}-{i}"
            sampling_i = sampling if g.n == 1 or g.seed is None else dataclasses.replace(
                sampling, seed=(g.seed + i) % (1 << 64))
            try:
                handle = await side.asubmit(Submit(
                    user, group, rid_i, prompt_ids, system_tokens, sampling_i,
                    top_logprobs=(g.top_logprobs or 0) if g.logprobs else None, report_mode=g.report_mode,
                    text=text, messages=messages, started=time.time()))
            except EngineError as exc:
                for t in turns:  # the choices already queued go too: the request failed as a whole
                    t.stream.cancel()
                raise ApiError(503 if engine_unavailable(str(exc)) else 400, str(exc)) from None
            turns.append(Turn(state, g, user, rid_i, sampling_i, HandleStream(handle), index=i, rid_base=rid,
                              miss_view=miss_view(g, ident)))
        if g.stream:
            return StreamingResponse(stream_turn(turns, slot), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

        async def drain(t):
            async for _ in t.pieces(request):
                pass

        await asyncio.gather(*(drain(t) for t in turns))
        if any(t.result is None for t in turns):  # the client went away: pieces() cancelled them
            return Response(status_code=499)
        failed = next((t for t in turns if t.result.error is not None), None)
        if failed is not None:
            raise engine_failure(failed.result)
        return JSONResponse(full_response(turns), headers={"X-Request-Id": rid})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.get("/v1/models")
    async def models(request: Request):
        identify(state, request)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvplay",
            "root": state.side.model_name, "parent": None,
            "max_model_len": state.side.max_positions}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize: the token ids a chat (`messages`) or completion (`prompt`) request's
        prompt would be, as generation builds it (kvplay attach predicts cache hits with it)."""
        identify(state, request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        g = parse(body, "chat" if "messages" in body else "completion")
        check_model(state, g.model)
        ids, _ = await run_in_threadpool(prepare_prompt, state, g)
        return {"count": len(ids), "max_model_len": state.side.max_positions, "tokens": ids}

    @app.get("/health")
    async def health():
        """200 while the engine thread runs and takes requests (in the engine-core process: while
        that process runs and its heartbeat says so); a request that failed (and ended alone)
        does not make the server unhealthy."""
        if not state.side.alive:
            return error_response(ApiError(503, "engine is down: its thread or its engine-core process has stopped",
                                           code="unavailable"))
        return Response(status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        ident = identify(state, request)
        if ident is not None and not ident.admin:  # with keys, only an admin key may wipe everyone's cache
            raise ApiError(403, "resetting the prefix cache drops every user's blocks: it needs a key "
                                "with admin = true in --api-keys", code="permission_denied")
        dropped = await run_in_threadpool(state.side.clear_cache)
        return JSONResponse({"ok": True, "dropped_blocks": dropped})

    @app.get("/metrics")
    async def metrics(request: Request):
        # who reuses whose cache is for the operator: user labels need an admin key (with keys)
        users = state.keys is None or state.metrics_users
        if not users and request.headers.get("authorization"):
            ident = lookup(state.keys, request.headers.get("authorization"))
            users = ident is not None and ident.admin
        def text() -> str:
            side = state.side
            return render_metrics(side.stats(0.2), side.metrics_snapshot(), state.model_name, users=users)

        return PlainTextResponse(await run_in_threadpool(text), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_info_routes(app, state, identify, read_json, check_model)
    return app
