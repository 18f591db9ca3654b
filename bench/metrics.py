"""What the bench measures, and the arithmetic on it (no model, no timing here).

Every peer produces one ``RequestRecord`` per request, with perf_counter timestamps:
``arrival`` (the round started: every user of a round asks at the same moment), ``first_token``
and ``end``. Summaries and ratios are pure functions of those records, so tests can check them
on made-up numbers.

Definitions
- TTFT = first_token - arrival; *cold* requests are the first round's (nothing of theirs was
  seen before), *warm* the later rounds'.
- decode tok/s (aggregate) = tokens after the first / the time during which at least one
  request was decoding (union of the [first_token, end] intervals): sequential peers add their
  intervals, concurrent ones overlap them.
- hit rate = prompt tokens reused from a cache / prompt tokens.
- ratio = kvplay / peer (for times < 1 is better; for tok/s > 1 is better).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    user: str
    round: int
    cold: bool
    prompt_tokens: int
    reused_tokens: int | None  # None: the peer cannot tell
    output_tokens: int
    arrival: float
    first_token: float
    end: float
    preemptions: int = 0

    @property
    def ttft_ms(self) -> float:
        return (self.first_token - self.arrival) * 1000

    @property
    def computed_tokens(self) -> int | None:
        return None if self.reused_tokens is None else self.prompt_tokens - self.reused_tokens


@dataclass
class PeerResult:
    peer: str  # short key: hf-generate, hf-cache-per-user, hf-cb, kvplay, kvplay-det
    label: str  # what a reader sees
    wall_s: float | None = None
    records: list[RequestRecord] = field(default_factory=list)
    peak_kv_bytes: int | None = None
    unavailable: str | None = None  # reason, when the peer could not run
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["records"] = [dict(asdict(r), ttft_ms=r.ttft_ms) for r in self.records]
        return d


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100] (got {q})")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError("interval ends before it starts")
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def summarize(result: PeerResult) -> dict:
    """The figures of one peer on one workload."""
    if result.unavailable:
        return {"peer": result.peer, "label": result.label, "unavailable": result.unavailable}
    recs = result.records
    cold = [r.ttft_ms for r in recs if r.cold]
    warm = [r.ttft_ms for r in recs if not r.cold]
    prompt = sum(r.prompt_tokens for r in recs)
    known = all(r.reused_tokens is not None for r in recs)
    reused = sum(r.reused_tokens for r in recs) if known else None
    decode_tokens = sum(max(0, r.output_tokens - 1) for r in recs)
    decode_s = union_seconds([(r.first_token, r.end) for r in recs])
    out = sum(r.output_tokens for r in recs)
    return {
        "peer": result.peer, "label": result.label, "requests": len(recs), "wall_s": result.wall_s,
        "ttft_cold_p50_ms": percentile(cold, 50), "ttft_cold_p95_ms": percentile(cold, 95),
        "ttft_warm_p50_ms": percentile(warm, 50), "ttft_warm_p95_ms": percentile(warm, 95),
        "ttft_p50_ms": percentile(cold + warm, 50),
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
        "throughput_tok_s": out / result.wall_s if result.wall_s else None,
        "output_tokens": out, "prompt_tokens": prompt, "reused_tokens": reused,
        "computed_tokens": None if reused is None else prompt - reused,
        "hit_rate": None if reused is None or not prompt else reused / prompt,
        "peak_kv_bytes": result.peak_kv_bytes,
        "preemptions": sum(r.preemptions for r in recs),
        **{k: v for k, v in result.extra.items() if k not in ("notes",)},
    }


# metric -> does a smaller value win?
COMPARED = {
    "wall_s": True, "ttft_cold_p50_ms": True, "ttft_warm_p50_ms": True, "ttft_warm_p95_ms": True,
    "decode_tok_s": False, "throughput_tok_s": False, "computed_tokens": True, "peak_kv_bytes": True,
}


def ratios(ours: dict, peer: dict) -> dict:
    """kvplay / peer for every compared metric both sides have."""
    if ours.get("unavailable") or peer.get("unavailable"):
        return {}
    out = {}
    for key in COMPARED:
        r = ratio(ours.get(key), peer.get(key))
        if r is not None:
            out[key] = r
    return out


@dataclass
class Target:
    name: str
    value: float | None
    threshold: float
    smaller_is_better: bool
    detail: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.threshold if self.smaller_is_better else self.value >= self.threshold

    def to_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "threshold": self.threshold,
                "smaller_is_better": self.smaller_is_better, "met": self.met, "detail": self.detail}


def speedup(ours: dict, peer: dict, key: str = "wall_s") -> float | None:
    """How many times faster kvplay is than `peer` on `key` (peer / kvplay)."""
    if ours.get("unavailable") or peer.get("unavailable"):
        return None
    return ratio(peer.get(key), ours.get(key))
