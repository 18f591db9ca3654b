"""The `--peer-url` peer: any OpenAI-compatible server with prefix caching (vLLM, SGLang,
`kvplay serve`), driven over HTTP with the workload's own token ids.

Every request is a streamed ``POST /v1/completions`` whose ``prompt`` is the token-id list (the
completions API accepts token-id prompts, so the server tokenizes nothing), with the workload's
number of new tokens (``max_tokens`` = N with ``ignore_eos``), greedy
(``temperature`` 0). TTFT is measured by this client, from the round's start to the first
streamed chunk that carries a choice; decode is measured from the first to the last chunk. The
server's own count of reused prompt tokens is read from the last chunk's
``usage.prompt_tokens_details.cached_tokens`` when it reports one (vLLM with
``--enable-prompt-tokens-details``), else it stays unknown.

Cold means cold: before the timed workload the peer gets one throwaway request (first-call
costs, as every other peer), then its prefix cache is emptied with ``POST /reset_prefix_cache``
(vLLM with ``VLLM_SERVER_DEV_MODE=1``, SGLang's ``/flush_cache``). When the server offers neither,
every prompt of this run gets one fresh random first token instead, so no block of an earlier run
can match; the report says which was done.
"""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from kvplay.serve.client import HttpPeer, why

from .metrics import PeerResult, RequestRecord
from .workloads import Workload

Progress = Callable[[str], None]
KEY = "peer-url"


def _quiet(msg: str) -> None:
    pass


def run_http_peer(peer: HttpPeer, workload: Workload, progress: Progress = _quiet, seed: int = 0) -> PeerResult:
    """Play `workload` through the server, round by round (a round's requests concurrently)."""
    res = PeerResult(KEY, peer.label)
    rng = random.Random(seed)
    try:
        # warm-up: a short throwaway request whose prompt shares no block with the workload
        peer.complete(list(reversed(workload.turns[0].prompt_ids[:24])), 2)
        if peer.reset_prefix_cache():
            prefix: list[int] = []
            res.extra["cold_by"] = f"POST {peer.reset_path}"
        else:
            vocab = sorted({t for turn in workload.turns for t in turn.prompt_ids})
            prefix = [rng.choice(vocab)]
            res.extra["cold_by"] = "a fresh random first token on every prompt (no reset endpoint)"
        n, done = len(workload.turns), 0
        mismatched = []
        t_start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(len(r) for r in workload.rounds)) as pool:
            for rnd in workload.rounds:
                arrival = time.perf_counter()
                futures = [pool.submit(peer.complete, prefix + t.prompt_ids, workload.new_tokens) for t in rnd]
                for turn, fut in zip(rnd, futures):
                    got = fut.result()
                    done += 1
                    progress(f"{KEY}: request {done}/{n}")
                    if got["prompt_tokens"] != len(prefix) + len(turn.prompt_ids):
                        mismatched.append(got["prompt_tokens"])
                    res.records.append(RequestRecord(turn.user, turn.round, turn.cold, len(turn.prompt_ids),
                                                     got["cached_tokens"], got["output_tokens"], arrival,
                                                     got["first"], got["end"]))
        res.wall_s = time.perf_counter() - t_start
        if mismatched:
            res.extra["note"] = (f"the server counted {mismatched[0]} prompt tokens where {KEY} sent a different "
                                 "number: is it serving another tokenizer?")
    except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
        res.unavailable = f"unavailable: {why(exc)}"
        res.records = []
    return res
