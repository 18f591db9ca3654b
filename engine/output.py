"""The output processor: from a step's logits to what the client sees.

For each request that produced logits this step it samples the next token (``sampling.py``,
the request's own seeded generator), detokenises *incrementally*, streams a ``TokenDelta`` to
the request's handle, keeps the per-request stats (TTFT, decode rate) and decides whether the
request is done (end of sequence, max tokens, context full). ``finish`` builds the final
``RequestResult`` and the ``RequestFinished`` event.

Incremental detokenising (as vLLM and TGI do): only a short window of the output is decoded per
token, ``ids[prefix:]`` against ``ids[prefix:read]``; the text between them is the new piece.
A window that ends inside a multi-byte character (U+FFFD) waits for the next token. So a token
costs O(window), not O(output) as re-decoding everything would, and the result's text is the
streamed pieces joined (a character still incomplete when the request stops is left out).

It knows nothing of blocks or scheduling.
"""
from __future__ import annotations

import time
from typing import Callable

from .events import Event, FirstToken, RequestFinished
from .request import Request, RequestResult, TokenDelta
from .sampling import sample


def make_decode(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text, without special tokens and without the "clean up spaces" pass some
    tokenizers apply (it looks across token boundaries, so windows would not add up)."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Per-request incremental decoder state (ids decoded so far: [0, read))."""
    __slots__ = ("prefix", "read")

    def __init__(self):
        self.prefix = 0  # start of the decode window (a token or more of left context)
        self.read = 0  # output ids already turned into text

    def step(self, decode: Callable[[list[int]], str], ids: list[int]) -> str:
        """The text that ids[read:] add (empty while a character is incomplete)."""
        if self.read >= len(ids):
            return ""
        before = decode(ids[self.prefix:self.read]) if self.read > self.prefix else ""
        now = decode(ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(ids)
        return now[len(before):]


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_positions: int, emit: Callable[[Event], None]):
        self.tokenizer = tokenizer
        self.decode = make_decode(tokenizer)
        self.eos_ids = eos_ids
        self.max_positions = max_positions
        self.emit = emit

    def process(self, req: Request, logits) -> str | None:
        """Sample, stream and check the stop conditions; returns the finish reason, if any."""
        if req.logits_trace is not None:
            req.logits_trace.append(logits.detach().cpu().clone())
        tok = sample(logits, req.sampling, req.generator)
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
            req.stats.ttft_ms = (now - req.arrival) * 1000
            self.emit(FirstToken(request_id=req.request_id, user=req.user, ttft_ms=req.stats.ttft_ms))
        if tok in self.eos_ids and req.sampling.stop_on_eos:
            return "stop"
        req.output_ids.append(tok)
        if req.detok is None:
            req.detok = Detokenizer()
        delta = req.detok.step(self.decode, req.output_ids)
        req.text += delta
        if req.handle is not None:
            req.handle._put(TokenDelta(req.request_id, delta, tok, len(req.output_ids) - 1))
        if len(req.output_ids) >= req.sampling.max_tokens or req.num_tokens >= self.max_positions:
            return "length"
        return None

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Final stats, the RequestFinished event and the handle's result."""
        now = time.perf_counter()
        st = req.stats
        st.output_tokens = len(req.output_ids)
        st.finish_reason = reason
        st.total_ms = (now - req.arrival) * 1000
        if req.first_token_time is not None and st.output_tokens > 1:
            st.decode_tok_s = (st.output_tokens - 1) / max(now - req.first_token_time, 1e-9)
        self.emit(RequestFinished(request_id=req.request_id, user=req.user, stats=st.to_dict(),
                                  finish_reason=reason, error=error))
        if req.handle is not None:
            req.handle._put(RequestResult(req.request_id, req.user, req.text, list(req.output_ids), st,
                                          reason, error))
