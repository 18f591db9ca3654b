"""One short, prepared GPU check (for a session lent a CUDA machine; nothing here runs in CI).

    python scripts/gpu_check.py [--model default] [--out DIR]

Checks, on --device cuda: the engine serves two users with cross-user reuse; cached vs cold
logits are close in default mode and bitwise equal in deterministic mode (and batch-invariant);
the deterministic-mode GEMM calibration result. Then runs `kvplay bench --quick --device cuda`
and saves its JSON. Prints one JSON summary line at the end.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=".")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()

    import torch

    from kvplay.engine.config import EngineConfig
    from kvplay.engine.engine import Engine
    from kvplay.engine.model import load_model
    from kvplay.engine.sampling import SamplingParams

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible", file=sys.stderr)
        return 2
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    loaded = load_model(args.model, device="cuda")
    out["dtype"] = str(loaded.dtype)
    system = {"role": "system", "content": "You are a careful assistant for a bakery. " * 20}
    msgs = [system, {"role": "user", "content": "When do you open on Sunday?"}]
    for det in (False, True):
        with Engine(EngineConfig(model=args.model, device="cuda", deterministic=det), loaded) as eng:
            cold = eng.submit("alice", msgs, SamplingParams(max_tokens=16), trace_logits=True)
            cold_res = cold.result(300)
            noise = [eng.submit(u, [system, {"role": "user", "content": f"noise {u}"}],
                                SamplingParams(max_tokens=16)) for u in "xyz"]
            warm = eng.submit("bob", msgs, SamplingParams(max_tokens=16), trace_logits=True)
            warm_res = warm.result(300)
            for h in noise:
                h.result(300)
            deltas = [float((a - b).abs().max()) for a, b in zip(cold.request.logits_trace, warm.request.logits_trace)]
            out["det" if det else "default"] = {
                "cached_tokens": warm_res.stats.cached_tokens, "cached_from": warm_res.stats.cached_from,
                "ttft_cold_ms": cold_res.stats.ttft_ms, "ttft_warm_ms": warm_res.stats.ttft_ms,
                "max_abs_dlogit": max(deltas), "bitwise": all(d == 0 for d in deltas),
                "same_text": cold_res.text == warm_res.text,
                "linear_plan": repr(eng.runner.linear_plan),
            }
    if not args.no_bench:
        t0 = time.perf_counter()
        bench_json = Path(args.out) / "bench_cuda.json"
        r = subprocess.run([sys.executable, "-m", "kvplay", "bench", "--quick", "--json", "--device", "cuda",
                            "--model", args.model], capture_output=True, text=True)
        bench_json.write_text(r.stdout)
        out["bench"] = {"rc": r.returncode, "seconds": round(time.perf_counter() - t0, 1), "json": str(bench_json)}
        if r.returncode == 0:
            rep = json.loads(r.stdout)
            out["bench"]["targets"] = {t["name"]: [round(t["value"], 3) if t["value"] is not None else None, t["met"]]
                                       for t in rep["targets"]}
        else:
            out["bench"]["stderr_tail"] = r.stderr[-2000:]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
