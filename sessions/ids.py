"""ULID-style ids: 26 Crockford base32 characters, 48-bit millisecond time then 80 random bits,
so ids sort by creation time (lexicographically) and never collide in practice."""
from __future__ import annotations

import os
import threading
import time

ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_lock = threading.Lock()
_last = [0, 0]  # last millisecond, last random part (monotonic within one millisecond)


def _b32(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_ulid(now: float | None = None) -> str:
    ms = int((time.time() if now is None else now) * 1000) & ((1 << 48) - 1)
    with _lock:
        if ms <= _last[0]:  # same (or earlier) millisecond: keep order by incrementing
            ms, rand = _last[0], (_last[1] + 1) & ((1 << 80) - 1)
        else:
            rand = int.from_bytes(os.urandom(10), "big")
        _last[0], _last[1] = ms, rand
    return _b32(ms, 10) + _b32(rand, 16)


def ulid_time(ulid: str) -> float:
    """Seconds since the epoch encoded in an id's first 10 characters."""
    ms = 0
    for ch in ulid[:10].upper():
        ms = ms * 32 + ALPHABET.index(ch)
    return ms / 1000
