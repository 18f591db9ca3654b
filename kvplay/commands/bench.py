"""`kvplay bench`: kvplay vs what a user would otherwise run, as ratios measured in one run."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvplay.bench.workloads import WORKLOADS
from kvplay.options import KvplayError, add_engine_args, check_output_file, config_from_args, save_plot


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="shared-system only, 2 turns (under two minutes on a 2-core CPU)")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON on stdout")
    parser.add_argument("--plot", metavar="FILE.png", help="also save a bar chart (matplotlib)")
    parser.add_argument("--workload", choices=WORKLOADS + ("all", "scale", "scrub", "miss"), default=None,
                        help="which workload (default: all; shared-system with --quick). `scale`: the engine "
                             "alone at pool sizes of a GPU workstation (step cost at 500,000 vs 512 blocks, "
                             "stats() cost, ready time and RSS at 1,000,000 blocks; tiny model, a few minutes). "
                             "`scrub`: opening and seeking a recorded session at 1,000,000 vs 512 blocks "
                             "(no model, seconds). `miss`: the engine step and the simulator with miss "
                             "attribution on vs off (tiny model, CPU time, a minute)")
    parser.add_argument("--users", type=int, default=None, help="users per round (default 4; pressure 8)")
    parser.add_argument("--turns", type=int, default=None,
                        help="turns per user (default 3, 2 with --quick; conversation 6)")
    parser.add_argument("--peers", default=None,
                        help="comma-separated subset of kvplay,hf-generate,hf-cache-per-user,hf-cb,kvplay-det")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="skip the decode probe (1 user vs N users)")
    parser.add_argument("--script", metavar="FILE.toml",
                        help="also play a `kvplay run` script as a workload (alone unless --workload is given), "
                             "e.g. examples/shared-system.toml")
    parser.add_argument("--peer-url", metavar="URL",
                        help="add a peer: an OpenAI-compatible server with prefix caching (vLLM, SGLang, "
                             "kvplay serve) at URL, e.g. http://127.0.0.1:8000, serving the same model")
    parser.add_argument("--peer-model", metavar="NAME",
                        help="the model name to ask --peer-url for (default: the only one it lists)")
    add_engine_args(parser)


def _progress(start: float):
    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return say


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    check_output_file(args.plot, "--plot", ".png")
    if args.peer_model and not args.peer_url:
        raise KvplayError("--peer-model needs --peer-url")
    # Lazy, the command boundary: the benchmarks import the engine, torch and transformers (5.7 s
    # niced on the 2-core machine); `kvplay bench --help` and a bad flag answer without them.
    from kvplay.bench import miss_bench, scrub_bench
    from kvplay.bench.report import plot_report, print_report, print_scale_report
    from kvplay.bench.run import PEER_ORDER, run_bench, run_scale_report

    if args.workload == "scale":
        for flag, v in (("--script", args.script), ("--peer-url", args.peer_url), ("--plot", args.plot)):
            if v:
                raise KvplayError(f"--workload scale measures the engine alone: drop {flag}")
        report = run_scale_report(progress=_progress(time.perf_counter()))
        return _show(report, args.json, print_scale_report)
    if args.workload == "scrub":
        for flag, v in (("--script", args.script), ("--peer-url", args.peer_url), ("--plot", args.plot)):
            if v:
                raise KvplayError(f"--workload scrub measures the scrubber alone: drop {flag}")
        return _show(scrub_bench.run(), args.json, scrub_bench.print_report)
    if args.workload == "miss":
        for flag, v in (("--script", args.script), ("--peer-url", args.peer_url), ("--plot", args.plot)):
            if v:
                raise KvplayError(f"--workload miss measures the attribution alone: drop {flag}")
        return _show(miss_bench.run(progress=_progress(time.perf_counter())), args.json, miss_bench.print_report)
    if args.script and not Path(args.script).is_file():
        raise KvplayError(f"--script {args.script}: no such file")
    if args.workload is None and args.script:
        names = []
    else:
        workload = args.workload or ("shared-system" if args.quick else "all")
        names = list(WORKLOADS) if workload == "all" else [workload]
    if args.script:
        names.append("script")
    turns = args.turns or (2 if args.quick and names == ["shared-system"] else None)
    for flag, v in (("--users", args.users), ("--turns", args.turns)):
        if v is not None and v < 1:
            raise KvplayError(f"{flag} must be at least 1")
    peers = PEER_ORDER
    if args.peers:
        peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
        bad = [p for p in peers if p not in PEER_ORDER]
        if bad:
            raise KvplayError(f"unknown peer {bad[0]!r} (choose from {', '.join(PEER_ORDER)})")
    report = run_bench(config, names, users=args.users, turns=turns, quick=args.quick, peers=peers,
                       probe=args.probe, progress=_progress(time.perf_counter()), script=args.script,
                       peer_url=args.peer_url, peer_model=args.peer_model)
    if args.plot:
        save_plot(lambda path: plot_report(report, path), args.plot)
    return _show(report, args.json, print_report)


def _show(report: dict, as_json: bool, print_text) -> int:
    """The report as indented JSON on stdout, or as text by `print_text`."""
    if as_json:
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
    else:
        print_text(report)
    return 0
