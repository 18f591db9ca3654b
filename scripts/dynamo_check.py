"""Does NVIDIA Dynamo's standalone KV indexer, fed by `kvplay serve`'s KV events, agree with
kvplay's `cached_tokens`? Prints one JSON object: per turn of a shared-system-prompt workload, the
prompt's tokens, the tokens Dynamo's index matched *before* the turn ran, and the cached tokens
kvplay's usage reported for it.

    unshare -rn sh -c 'ip link set lo up && exec .venv/bin/python scripts/dynamo_check.py \
        --dynamo-python "$(scripts/dynamo-setup.sh path)"'

Dynamo's indexer listens on every interface (it has no host option), so run this in a network
namespace that has only loopback (`unshare -rn`, as above; tests/interop/test_interop_dynamo.py does).
Set up the indexer with scripts/dynamo-setup.sh. Nothing here leaves the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx

SYSTEM = ("You are the assistant of a small bakery in a quiet town. Answer every customer briefly, "
          "kindly and in plain words, and never invent prices. ") * 3
TURNS = [("alice", "Do you sell rye bread?"), ("bob", "When do you open on Sundays?"),
         ("carol", "Do you bake gluten-free cakes?"), ("bob", "Can I order a birthday cake?")]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"dynamo_check: {url}: the process exited ({proc.returncode})")
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise SystemExit(f"dynamo_check: {url} never answered")


def matched_tokens(c: httpx.Client, dyn: str, model: str, ids: list[int], block: int) -> int:
    """Dynamo's best overlap for `ids`, in tokens: the standalone indexer's HTTP /query scores
    are matched tokens per worker (1.6.1; checked: a block-aligned prompt scores its length)."""
    r = c.post(f"{dyn}/query", json={"token_ids": ids, "model_name": model})
    r.raise_for_status()
    scores = r.json().get("scores") or {}
    best = 0

    def walk(v):
        nonlocal best
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            best = max(best, int(v))

    walk(scores)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dynamo-python", required=True)
    ap.add_argument("--model", default="tiny:llama", help="kvplay serve's --model (default tiny:llama)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--indexer-port", type=int, default=8090)
    args = ap.parse_args()
    bs, model = args.block_size, "kvplay-check"
    ev, rep = "tcp://*:5557", "tcp://*:5558"
    kv_cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": ev, "replay_endpoint": rep})
    serve = subprocess.Popen([sys.executable, "-m", "kvplay", "serve", "--model", args.model, "--port", str(args.port),
                              "--block-size", str(bs), "--num-blocks", "256", "--served-model-name", model,
                              "--kv-events-config", kv_cfg, "--no-record"], stderr=subprocess.DEVNULL)
    indexer = subprocess.Popen([args.dynamo_python, "-m", "dynamo.indexer", "--port", str(args.indexer_port),
                                "--block-size", str(bs), "--model-name", model, "--threads", "1",
                                "--workers", "1=tcp://127.0.0.1:5557"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=dict(os.environ, RUST_LOG="warn"))
    url, dyn = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.indexer_port}"
    out = {"block_size": bs, "model": args.model, "turns": []}
    try:
        wait_http(url + "/health", serve)
        wait_http(dyn + "/workers", indexer)
        with httpx.Client(timeout=300) as c:
            def tokens(messages):
                return c.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]

            def chat(user, messages):
                r = c.post(url + "/v1/chat/completions", json={"model": model, "messages": messages, "user": user,
                                                               "max_tokens": 2, "temperature": 0})
                r.raise_for_status()
                return r.json()["usage"]

            def indexed(ids, timeout=30.0):
                want = len(ids) // bs * bs
                end = time.monotonic() + timeout
                while matched_tokens(c, dyn, model, ids, bs) < want:
                    if time.monotonic() > end:
                        return False
                    time.sleep(0.1)
                return True

            # warm-up: until the indexer's SUB has joined, what the server publishes is lost to it
            warm = [{"role": "user", "content": "warm-up " * 40}]
            for _ in range(30):
                c.post(url + "/reset_prefix_cache")
                chat("warm-up", warm)
                if indexed(tokens(warm), timeout=2):
                    break
            else:
                raise SystemExit("dynamo_check: the indexer never saw an event")
            for user, question in TURNS:
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
                ids = tokens(messages)
                before = matched_tokens(c, dyn, model, ids, bs)
                usage = chat(user, messages)
                out["turns"].append({"user": user, "prompt_tokens": usage["prompt_tokens"], "dynamo_tokens": before,
                                     "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
                indexed(ids)
            # a fully cached, block-aligned prompt: Dynamo counts it whole, kvplay recomputes the last block
            ids = tokens(messages)
            cut = len(ids) // bs * bs
            dyn_aligned = matched_tokens(c, dyn, model, ids[:cut], bs)
            r = c.post(url + "/v1/completions", json={"model": model, "prompt": ids[:cut], "max_tokens": 2,
                                                       "temperature": 0, "user": "bob"})
            r.raise_for_status()
            out["aligned"] = {"prompt_tokens": cut, "dynamo_tokens": dyn_aligned,
                              "cached_tokens": r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]}
    finally:
        for p in (indexer, serve):
            p.terminate()
        for p in (indexer, serve):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
