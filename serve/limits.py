"""Bounded work before admission: what a request may cost before the engine sees it.

- ``Admission``: at most `limit` generation requests in flight (a stream counts until it ends);
  one more is a 503 with ``Retry-After``, answered before its body is read.
- ``check_prompt_size``: a prompt whose text cannot fit the model's context is refused by its
  length in characters, before tokenizing (a token is at most MAX_CHARS_PER_TOKEN characters
  here; a longer prompt would be cut by the context check anyway, after seconds of tokenizer time).
- ``TokenizerPool``: a few copies of the tokenizer, so one long prompt occupies one copy and
  others tokenize on the rest (HF fast tokenizers must not be shared between threads at once:
  "Already borrowed"); no global lock held for a whole tokenization.
"""
from __future__ import annotations

import copy
import queue
import threading

from .protocol import ApiError, bad

MAX_CHARS_PER_TOKEN = 32
MAX_PROMPT_CHARS = 1 << 20  # whatever the context: 1 Mi characters
RETRY_AFTER_S = 1


class Slot:
    """One admitted request; `release` is idempotent and also runs when the slot is dropped
    (a streamed response whose generator never started still gives its slot back)."""
    __slots__ = ("_adm", "_held")

    def __init__(self, adm: "Admission"):
        self._adm, self._held = adm, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._adm._release()

    def __del__(self):
        self.release()


class Admission:
    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0
        self.refused = 0
        self._lock = threading.Lock()

    def enter(self) -> Slot:
        with self._lock:
            if self.active >= self.limit:
                self.refused += 1
                raise ApiError(503, f"the server is at its limit of {self.limit} concurrent requests; retry later",
                               code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
            self.active += 1
        return Slot(self)

    def _release(self) -> None:
        with self._lock:
            self.active -= 1


def prompt_chars(g) -> int:
    if g.kind == "chat":
        return sum(len(m["content"]) for m in g.messages)
    return len(g.prompt or "")


def check_prompt_size(g, context: int) -> None:
    """Refuse, before tokenizing, a prompt too long in characters to fit `context` tokens."""
    limit = min(MAX_PROMPT_CHARS, context * MAX_CHARS_PER_TOKEN)
    n = prompt_chars(g)
    if n > limit:
        raise bad(f"the prompt is {n} characters; this server takes at most {limit} (the model's context is "
                  f"{context} tokens). Please reduce the length of the input.",
                  "messages" if g.kind == "chat" else "prompt", "context_length_exceeded")


class TokenizerPool:
    """Up to `size` copies of `tokenizer`, each used by one thread at a time. The copies are made
    on a thread of their own as the server starts (a deep copy of a fast tokenizer holds the GIL
    for ~0.5 s: made on the first burst of requests, it stalled the engine's steps)."""

    def __init__(self, tokenizer, size: int = 4):
        self._free: "queue.SimpleQueue" = queue.SimpleQueue()
        self._free.put(tokenizer)
        self._tok = tokenizer
        self.copies = 1
        if size > 1:
            threading.Thread(target=self._copy, args=(size - 1,), name="kvplay-tokenizer-copies",
                             daemon=True).start()

    def _copy(self, n: int) -> None:
        for _ in range(n):
            try:
                tok = copy.deepcopy(self._tok)
            except Exception:  # a tokenizer that cannot be copied: the one there is serves all
                return
            self.copies += 1
            self._free.put(tok)

    def _take(self):
        return self._free.get()

    def run(self, fn, *args):
        """fn(tokenizer, *args) with a tokenizer no other thread uses meanwhile."""
        tok = self._take()
        try:
            return fn(tok, *args)
        finally:
            self._free.put(tok)
