"""The peers: what a user would otherwise run on the same prompts, and kvplay itself.

Each ``run_*`` function plays a Workload round by round and returns a PeerResult. Every user of
a round "asks" at the round's start (``arrival``); sequential peers serve them one after the
other, so their later users wait, as they would behind a one-request-at-a-time server.

The Hugging Face peers need their own copy of the model: kvplay's ModelRunner switches the
model it runs to its paged attention (``_attn_implementation = "kvplay_paged"``).
"""
from __future__ import annotations

import inspect
import logging
import time
from typing import Callable

import torch
from transformers import DynamicCache

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.sampling_params import SamplingParams
from kvplay.engine.threads import on_fresh_thread

from .metrics import PeerResult, RequestRecord, union_seconds
from .workloads import Turn, Workload, shared_prefix_len

Progress = Callable[[str], None]

LABELS = {
    "hf-generate": "HF generate, no reuse",
    "hf-cache-per-user": "HF generate, DynamicCache per user",
    "hf-cb": "transformers continuous batching (block sharing)",
    "kvplay": "kvplay (default)",
    "kvplay-det": "kvplay --deterministic",
}


def _quiet(msg: str) -> None:
    pass


# --- Hugging Face generate ----------------------------------------------------------------------

class _FirstTokenClock:
    """A generate() streamer that notes when the first new token arrives (the first put() is the
    prompt itself)."""

    def __init__(self):
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def cache_bytes(cache) -> int:
    """Bytes held by a transformers DynamicCache's K/V tensors."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _hf_generate_one(model, prompt_ids: list[int], new_tokens: int, cache=None):
    """Greedy generate exactly `new_tokens`; returns (output ids, first-token time, end time)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    clock = _FirstTokenClock()
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  streamer=clock, pad_token_id=_pad_id(model))
    if cache is not None:
        kwargs[_cache_kw(model)] = cache
    out = model.generate(**kwargs)
    end = time.perf_counter()
    return out[0].tolist(), clock.first or end, end


def _cache_kw(model) -> str:
    """transformers >= 5.24 calls the cache argument `cache` (`past_key_values` is deprecated)."""
    inner = getattr(model, "model", None)
    params = inspect.signature(inner.forward).parameters if inner is not None else {}
    return "cache" if "cache" in params else "past_key_values"


def _pad_id(model) -> int:
    gc = model.generation_config
    pad = getattr(gc, "pad_token_id", None)
    if pad is None:
        eos = getattr(gc, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    return 0 if pad is None else int(pad)


def _new_cache(model):
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older signature
        return DynamicCache()


def run_hf_generate(model, workload: Workload, per_user_cache: bool = False,
                    progress: Progress = _quiet) -> PeerResult:
    """Peer 1 (no reuse: every prompt recomputed) or peer 2 (one DynamicCache per user, kept
    across that user's turns and cropped to the common prefix with the new prompt)."""
    key = "hf-cache-per-user" if per_user_cache else "hf-generate"
    res = PeerResult(key, LABELS[key])
    caches: dict[str, tuple[object, list[int]]] = {}
    peak = 0
    n = len(workload.turns)
    done = 0
    t_start = time.perf_counter()
    with torch.inference_mode():
        for rnd in workload.rounds:
            arrival = time.perf_counter()
            for turn in rnd:
                done += 1
                progress(f"{key}: request {done}/{n}")
                reused = 0
                if per_user_cache:
                    cache, have = caches.get(turn.user, (None, []))
                    if cache is None:
                        cache = _new_cache(model)
                    keep = min(shared_prefix_len([have, turn.prompt_ids]), len(turn.prompt_ids) - 1)
                    cur = cache.get_seq_length() if have else 0
                    if cur > keep:
                        cache.crop(-(cur - keep))
                    reused = keep if have else 0
                else:
                    cache = _new_cache(model)
                out, first, end = _hf_generate_one(model, turn.prompt_ids, workload.new_tokens, cache)
                output = len(out) - len(turn.prompt_ids)
                if per_user_cache:
                    caches[turn.user] = (cache, out[:-1])  # the last token was never fed back
                    peak = max(peak, sum(cache_bytes(c) for c, _ in caches.values()))
                else:
                    peak = max(peak, cache_bytes(cache))
                res.records.append(RequestRecord(turn.user, turn.round, turn.cold, len(turn.prompt_ids), reused,
                                                 output, arrival, first, end))
    res.wall_s = time.perf_counter() - t_start
    res.peak_kv_bytes = peak
    return res


# --- transformers continuous batching -----------------------------------------------------------

def run_hf_cb(model, workload: Workload, block_size: int, num_blocks: int, max_batch_tokens: int,
              progress: Progress = _quiet, round_timeout: float = 300.0) -> PeerResult:
    """Peer 3: transformers' continuous batching manager with block sharing on, kept alive across
    rounds (so later rounds can reuse earlier blocks), same page size and pool size as kvplay."""
    key = "hf-cb"
    res = PeerResult(key, LABELS[key])
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError as exc:  # kept: transformers' continuous batching is outside kvplay and its
        # module layout moves between releases; without it this one peer is reported unavailable
        res.unavailable = f"unavailable: this transformers has no continuous batching ({exc})"
        return res

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "eos_token_id not set": on purpose
    original_attn = model.config._attn_implementation
    gen = GenerationConfig(max_new_tokens=workload.new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=_pad_id(model))
    try:
        cb = ContinuousBatchingConfig(allow_block_sharing=True, page_size=block_size, num_blocks=num_blocks,
                                      max_batch_tokens=max_batch_tokens)
        hints = WorkloadHints(max_prompt_length=max(len(t.prompt_ids) for t in workload.turns),
                              max_generated_length=workload.new_tokens, num_requests=len(workload.turns))
        manager = model.init_continuous_batching(gen, cb, workload_hints=hints)
    except Exception as exc:  # CPU or version limits show up here
        res.unavailable = f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return res
    n, done = len(workload.turns), 0
    try:
        # Warm it the way transformers does by default (generate_batch and the context manager call
        # warmup() before start(); on CPU without padding it returns at once), then one throwaway
        # request, as kvplay gets, so first-call costs land on nobody's figures. Its prompt shares
        # no block with the workload (reversed tokens), so it leaves nothing the workload can reuse.
        manager.warmup()
        manager.start()
        _hf_cb_throwaway(manager, list(reversed(workload.turns[0].prompt_ids[:24])), round_timeout)
        res.extra.update(warmed_up=bool(getattr(manager, "warmed_up", False)), throwaway_requests=1)
        t_start = time.perf_counter()
        for rnd in workload.rounds:
            arrival = time.perf_counter()
            ids = {}
            for turn in rnd:
                rid = manager.add_request(turn.prompt_ids, max_new_tokens=workload.new_tokens,
                                          record_timestamps=True, eos_token_id=-1)
                ids[rid] = turn
            got = {}
            deadline = time.monotonic() + round_timeout
            while len(got) < len(ids):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a round took more than {round_timeout:.0f} s")
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped")
                    continue
                if out.request_id in ids and out.is_finished():
                    if out.error:
                        raise RuntimeError(str(out.error).splitlines()[0][:160])
                    got[out.request_id] = out
                    done += 1
                    progress(f"{key}: request {done}/{n}")
            for rid, turn in ids.items():
                out = got[rid]
                stamps = out.timestamps or [time.perf_counter()]
                res.records.append(RequestRecord(turn.user, turn.round, turn.cold, len(turn.prompt_ids), None,
                                                 len(out.generated_tokens), arrival, stamps[0], stamps[-1]))
        res.wall_s = time.perf_counter() - t_start
    except Exception as exc:
        res.unavailable = f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        res.records = []
    finally:
        try:
            manager.stop(block=True, timeout=30)
        except Exception:
            pass
        try:
            model.destroy_cached_continuous_batching_manager()
        except Exception:
            pass
        if model.config._attn_implementation != original_attn:
            model.set_attn_implementation(original_attn)
    res.extra["kv_pool_bytes"] = None
    return res


def _hf_cb_throwaway(manager, prompt_ids: list[int], timeout: float) -> None:
    rid = manager.add_request(prompt_ids, max_new_tokens=2, eos_token_id=-1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = manager.get_result(request_id=rid, timeout=1)
        if out is not None and out.is_finished():
            if out.error:
                raise RuntimeError(str(out.error).splitlines()[0][:160])
            return
        if out is None and not manager.is_running():
            raise RuntimeError("the continuous batching thread stopped")
    raise TimeoutError(f"the warm-up request took more than {timeout:.0f} s")


# --- kvplay ---------------------------------------------------------------------------------------

class _PeakBlocks:
    """Batch subscriber: the most non-free blocks at the end of a step (runs on the engine
    thread, where the engine's O(1) counters are read without waiting)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.peak = 0

    def __call__(self, batch) -> None:
        s = self.engine.stats()
        self.peak = max(self.peak, s["blocks_total"] - s["blocks_free"])


def submit_together(engine: Engine, turns: list[Turn], sampling: SamplingParams):
    """Submit a round's turns in one engine call, so they arrive in the same scheduler step (a
    plain loop of submit() lets the engine run a step between two submissions)."""
    def submit_all():
        return [engine.submit(t.user, prompt_ids=t.prompt_ids, system_tokens=t.system_tokens, sampling=sampling)
                for t in turns]

    return engine.call(submit_all)


def kvplay_config(base: EngineConfig, workload: Workload, deterministic: bool) -> EngineConfig:
    changes = {"deterministic": deterministic}
    if workload.num_blocks is not None:
        changes["num_blocks"] = workload.num_blocks
    return base.replace(**changes).validate()


def warm_up_engine(engine: Engine, prompt_ids: list[int]) -> None:
    """One short throwaway request (first-call costs), then an empty cache."""
    engine.submit("warmup", prompt_ids=prompt_ids[:24], sampling=SamplingParams(max_tokens=2,
                                                                                  stop_on_eos=False)).result(600)
    engine.clear_cache()


def run_kvplay(loaded, workload: Workload, base: EngineConfig, deterministic: bool = False,
               progress: Progress = _quiet) -> PeerResult:
    key = "kvplay-det" if deterministic else "kvplay"
    cfg = kvplay_config(base, workload, deterministic)
    # what a server peer may set otherwise (vLLM CPU: block 32, up to 2048 prompt tokens a step)
    sampling = SamplingParams(temperature=0.0, max_tokens=workload.new_tokens, stop_on_eos=False)
    engine = Engine(cfg, loaded).start()
    res = PeerResult(key, f"{LABELS[key]} · block {cfg.block_size}, prefill budget {cfg.prefill_budget} "
                          f"tokens a step, decode attention: {engine.decode_attention()}")
    try:
        warm_up_engine(engine, workload.turns[0].prompt_ids)
        peak = _PeakBlocks(engine)
        unsubscribe = engine.subscribe_batches(peak)
        n, done = len(workload.turns), 0
        t_start = time.perf_counter()
        for rnd in workload.rounds:
            arrival = time.perf_counter()
            handles = submit_together(engine, rnd, sampling)
            for turn, h in zip(rnd, handles):
                r = h.result(600)
                if r.error:
                    raise RuntimeError(f"kvplay request failed: {r.error}")
                req = h.request
                st = r.stats
                end = req.arrival + (st.total_ms or 0) / 1000
                done += 1
                progress(f"{key}: request {done}/{n}")
                res.records.append(RequestRecord(turn.user, turn.round, turn.cold, st.prompt_tokens,
                                                 st.cached_tokens, st.output_tokens, arrival,
                                                 req.first_token_time or end, end, st.preemptions))
        res.wall_s = time.perf_counter() - t_start
        unsubscribe()
        stats = engine.stats()
        res.peak_kv_bytes = peak.peak * stats["block_bytes"]
        res.extra.update(evictions=stats["evictions"], pool_blocks=stats["blocks_total"],
                         pool_bytes=stats["pool_bytes"], forwards=stats["forwards"])
    finally:
        engine.shutdown()
    return res


# --- decode probe -----------------------------------------------------------------------------------

def decode_probe(loaded_kv, hf_model, workload: Workload, base: EngineConfig, users: int,
                 progress: Progress = _quiet) -> dict:
    """Decode tok/s of kvplay at one user and at `users` concurrent users (system prompt already
    cached, so the rounds are nearly all decode), and of HF generate + DynamicCache at one user."""
    first_round = workload.rounds[0]
    turns = [first_round[i % len(first_round)] for i in range(users)]
    sampling = SamplingParams(temperature=0.0, max_tokens=workload.new_tokens, stop_on_eos=False)
    cfg = base.replace(deterministic=False).validate()

    def agg(records: list[tuple[float, float, int]]) -> float | None:
        span = union_seconds([(a, b) for a, b, _ in records])
        toks = sum(max(0, n - 1) for _, _, n in records)
        return toks / span if span > 0 else None

    engine = Engine(cfg, loaded_kv).start()
    try:
        warm_up_engine(engine, turns[0].prompt_ids)
        progress("latency probe: kvplay, one request alone, cold then warm")
        one_token = SamplingParams(max_tokens=1, stop_on_eos=False)
        cold = submit_together(engine, turns[:1], one_token)[0].result(600).stats.ttft_ms
        other = first_round[1] if len(first_round) > 1 else first_round[0]
        warm = submit_together(engine, [other], one_token)[0].result(600).stats.ttft_ms
        progress("decode probe: kvplay, 1 user")

        def play(ts):
            handles = submit_together(engine, ts, sampling)
            out = []
            for h in handles:
                r = h.result(600)
                req = h.request
                out.append((req.first_token_time, req.arrival + r.stats.total_ms / 1000, r.stats.output_tokens))
            return agg(out)

        one = play(turns[:1])
        progress(f"decode probe: kvplay, {users} users at once")
        many = play(turns)
    finally:
        engine.shutdown()
    progress("decode probe: HF generate + DynamicCache, 1 user")

    def hf_decode():
        with torch.inference_mode():
            cache = _new_cache(hf_model)
            _hf_generate_one(hf_model, turns[0].prompt_ids, 1, cache)  # prefill, like the engine's cached prefix
            cache.crop(-(cache.get_seq_length() - (len(turns[0].prompt_ids) - 1)))
            return _hf_generate_one(hf_model, turns[0].prompt_ids, workload.new_tokens, cache)

    out, first, end = on_fresh_thread(hf_decode)  # a thread that ends: no OpenMP pool left behind
    hf_one = agg([(first, end, len(out) - len(turns[0].prompt_ids))])
    return {"users": users, "kvplay_alone_cold_ttft_ms": cold, "kvplay_alone_warm_ttft_ms": warm,
            "kvplay_1_user_tok_s": one, "kvplay_n_users_tok_s": many, "hf_1_user_tok_s": hf_one}
