"""Run the bench: load the model twice (kvplay's copy and the HF peers' copy), play each
workload through every peer in one process, then the decode probe, and build the report."""
from __future__ import annotations

import os
import time
from typing import Callable

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import pool_blocks
from kvplay.engine.errors import EngineError
from kvplay.engine.model import load_model
from kvplay.engine.threads import cpu_threads, on_fresh_thread, set_cpu_threads

from . import peers as P
from .metrics import Target, ratio, ratios, speedup, summarize
from .http_peer import HttpPeer, KEY as HTTP_KEY
from .http_peer import run_http_peer
from .scale import run_scale, scale_targets
from .workloads import WORKLOADS, build_workload, script_workload

PEER_ORDER = ("kvplay", "hf-generate", "hf-cache-per-user", "hf-cb", "kvplay-det")
BASELINES = ("hf-generate", "hf-cache-per-user", "hf-cb")


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_bench(config: EngineConfig, workloads: list[str], users: int | None = None, turns: int | None = None,
              quick: bool = False, peers: tuple[str, ...] = PEER_ORDER, probe: bool = True,
              progress: Callable[[str], None] = P._quiet, system_prompt: str | None = None,
              script: str | None = None, peer_url: str | None = None, peer_model: str | None = None,
              new_tokens: int | None = None) -> dict:
    """Play `workloads` through `peers`; return the report dict (see docs/bench.md).

    `script`: a `kvplay run` script, played as the workload "script" (bench/workloads.py).
    `peer_url`: an OpenAI-compatible server, played as the peer "peer-url" (bench/http_peer.py)."""
    t0 = time.perf_counter()
    for w in workloads:
        if w not in WORKLOADS + ("script",):
            raise EngineError(f"unknown workload {w!r} ({', '.join(WORKLOADS)}, all)")
    if "script" in workloads and not script:
        raise EngineError("the script workload needs --script FILE")
    unknown = set(peers) - set(PEER_ORDER)
    if unknown:
        raise EngineError(f"unknown peer(s) {', '.join(sorted(unknown))} ({', '.join(PEER_ORDER)})")
    http = None
    if peer_url:
        http = HttpPeer(peer_url, peer_model).connect()  # one clear line when it cannot be reached
    load_avg_start = _load_avg()
    # Every peer runs with the engine's thread count (set once, process-wide, before any timing).
    set_cpu_threads(config.threads)
    hf_needed = bool(set(peers) & set(BASELINES)) or (probe and "kvplay" in peers)
    progress(f"loading {config.model}" + (" twice (kvplay's copy, and the Hugging Face peers' copy)"
                                          if hf_needed else ""))
    # Torch's parallel work runs only on threads that end (engine/threads.py): the loads and the
    # Hugging Face peers here, kvplay on its engine thread. An OpenMP pool left on this thread
    # would slow whichever peer runs on another one (libgomp's throttled waits).
    loaded_kv = on_fresh_thread(lambda: load_model(config.model, config.device, config.dtype, progress=progress))
    hf_model = None
    if hf_needed:
        hf_model = on_fresh_thread(lambda: load_model(config.model, config.device, config.dtype, progress=progress).model)
        if hf_model.config._attn_implementation not in ("sdpa", "eager"):
            hf_model.set_attn_implementation("sdpa")
    extra = {} if system_prompt is None else {"system_prompt": system_prompt}
    if new_tokens is not None:
        extra["new_tokens"] = new_tokens

    def workload(name: str):
        if name == "script":
            return script_workload(script, loaded_kv.tokenizer, new_tokens)
        return build_workload(name, loaded_kv.tokenizer, users, turns, config.block_size, **extra)

    # torch_threads: the count the engines and peers run with, not torch.get_num_threads() here
    # (libgomp keeps it per thread, and this thread runs no torch work: engine/threads.py)
    report = {
        "model": loaded_kv.name, "device": str(loaded_kv.device), "dtype": str(loaded_kv.dtype).replace("torch.", ""),
        "quick": quick, "config": config.to_dict(), "torch_threads": cpu_threads(config.threads),
        "cpu_count": os.cpu_count(), "load_avg_start": load_avg_start, "workloads": [],
    }
    if http is not None:
        report["peer_url"] = {"url": http.base, "model": http.model, "label": http.label}
    if hf_model is not None:
        # warm the HF copy once so first-call costs land on nobody's figures
        progress("warming up the Hugging Face copy")
        on_fresh_thread(P._hf_generate_one, hf_model, workload(workloads[0]).turns[0].prompt_ids[:24], 2)
    run_peers = tuple(peers) + ((HTTP_KEY,) if http is not None else ())
    for name in workloads:
        wl = workload(name)
        name = wl.name
        progress(f"workload {name}: {wl.description} ({len(wl.turns)} requests, "
                 f"{wl.prompt_tokens()} prompt tokens)")
        cfg_kv = P.kvplay_config(config, wl, False)
        results = {}
        for peer in run_peers:
            progress(f"{name}: {http.label if peer == HTTP_KEY else P.LABELS[peer]} …")
            load_before = _load_avg()
            if peer == HTTP_KEY:
                r = run_http_peer(http, wl, progress)
            elif peer in ("kvplay", "kvplay-det"):
                r = P.run_kvplay(loaded_kv, wl, config, peer == "kvplay-det", progress)
            elif peer in ("hf-generate", "hf-cache-per-user"):
                r = on_fresh_thread(P.run_hf_generate, hf_model, wl, peer == "hf-cache-per-user", progress)
            else:  # hf-cb
                r = on_fresh_thread(P.run_hf_cb, hf_model, wl, cfg_kv.block_size, pool_blocks(loaded_kv, cfg_kv),
                                    cfg_kv.prefill_budget + cfg_kv.max_running, progress)
            # the machine's 1-minute load around this peer: on a shared machine, ratios between
            # peers that ran under different loads mean little
            if load_before is not None:
                r.extra["load_1min"] = [load_before[0], (_load_avg() or [None])[0]]
            results[peer] = r
            progress(f"{name}: {peer} " + (r.unavailable if r.unavailable else f"done in {r.wall_s:.1f} s"))
        report["workloads"].append(workload_report(wl, results))
    if probe and "kvplay" in peers:
        wl = build_workload("shared-system", loaded_kv.tokenizer, users, 1, config.block_size, **extra)
        report["decode_probe"] = P.decode_probe(loaded_kv, hf_model, wl, config, users or 4, progress)
    if http is not None:
        http.close()
    report["targets"] = [t.to_dict() for t in targets(report)]
    report["load_avg_end"] = _load_avg()
    report["elapsed_s"] = time.perf_counter() - t0
    return report


def run_scale_report(progress: Callable[[str], None] = P._quiet, **kwargs) -> dict:
    """The `scale` workload (bench/scale.py): the engine alone at GPU-workstation pool sizes, on
    the tiny model (metadata-heavy: its steps are cheap, so per-block costs show)."""
    t0 = time.perf_counter()
    load_avg_start = _load_avg()
    result = run_scale(progress=progress, **kwargs)
    return {"workload": "scale", "cpu_count": os.cpu_count(), "torch_threads": cpu_threads(None),
            "load_avg_start": load_avg_start, "load_avg_end": _load_avg(), "scale": result,
            "targets": [t.to_dict() for t in scale_targets(result)], "elapsed_s": time.perf_counter() - t0}


def workload_report(wl, results: dict) -> dict:
    summaries = {k: summarize(r) for k, r in results.items()}
    ours = summaries.get("kvplay")
    out = {"workload": wl.summary(), "peers": summaries,
           "raw": {k: r.to_dict() for k, r in results.items()}, "ratios": {}, "speedups": {}}
    if ours:
        for k, s in summaries.items():
            if k != "kvplay":
                out["ratios"][k] = ratios(ours, s)
                out["speedups"][k] = speedup(ours, s)
        if not ours.get("unavailable"):
            out["kvplay_warm_cold_ttft"] = ratio(ours.get("ttft_warm_p50_ms"), ours.get("ttft_cold_p50_ms"))
    return out


def targets(report: dict) -> list[Target]:
    """The issue's targets, from the shared-system workload and the decode probe."""
    out: list[Target] = []
    ws = {w["workload"]["name"]: w for w in report["workloads"]}
    ss = ws.get("shared-system")
    if ss:
        peers = ss["peers"]
        out.append(Target("shared-system warm/cold TTFT p50 (kvplay)", ss.get("kvplay_warm_cold_ttft"), 0.15, True))
        out.append(Target("shared-system wall: x faster than HF generate", ss["speedups"].get("hf-generate"), 2.0,
                          False))
        cb = peers.get("hf-cb", {})
        out.append(Target("shared-system wall: x faster than HF continuous batching", ss["speedups"].get("hf-cb"),
                          1.25, False, cb.get("unavailable", "")))
        det, ours = peers.get("kvplay-det"), peers.get("kvplay")
        if det and ours:
            out.append(Target("deterministic wall / default wall", ratio(det.get("wall_s"), ours.get("wall_s")),
                              1.5, True))
    for w in report["workloads"]:
        peer = w["peers"].get(HTTP_KEY)
        if peer is None or "kvplay" not in w["peers"]:
            continue
        why = peer.get("unavailable", "")
        name = w["workload"]["name"]
        ours = w["peers"]["kvplay"]
        # the targets: kvplay level with the server on cold TTFT, warm TTFT and decode
        out.append(Target(f"{name}: cold TTFT p50, {HTTP_KEY} / kvplay", ratio(peer.get("ttft_cold_p50_ms"),
                          ours.get("ttft_cold_p50_ms")), 1.0, False, why))
        out.append(Target(f"{name}: warm TTFT p50, {HTTP_KEY} / kvplay", ratio(peer.get("ttft_warm_p50_ms"),
                          ours.get("ttft_warm_p50_ms")), 1.0, False, why))
        out.append(Target(f"{name}: decode tok/s, kvplay / {HTTP_KEY}", ratio(ours.get("decode_tok_s"),
                          peer.get("decode_tok_s")), 1.0, False, why))
    probe = report.get("decode_probe")
    if probe:
        out.append(Target("warm/cold TTFT p50 of one request alone (kvplay)", ratio(
            probe["kvplay_alone_warm_ttft_ms"], probe["kvplay_alone_cold_ttft_ms"]), 0.15, True,
            "latency probe: no other request in flight"))
        out.append(Target("decode 1 user: kvplay / HF DynamicCache", ratio(probe["kvplay_1_user_tok_s"],
                                                                           probe["hf_1_user_tok_s"]), 0.95, False))
        out.append(Target(f"decode {probe['users']} users / 1 user (kvplay aggregate)",
                          ratio(probe["kvplay_n_users_tok_s"], probe["kvplay_1_user_tok_s"]), 3.0, False))
    return out
