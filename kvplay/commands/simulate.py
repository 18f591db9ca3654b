"""`kvplay simulate SESSION_ID|TRACE [--num-blocks N …] [--policy lru,lfu,fifo,belady]
[--isolation …] [--json] [--plot PNG] [--db PATH]`.

Replays a recorded session (or a trace file: vLLM KV events, Mooncake JSONL) through the real
scheduler and block pool with no model, once per setting, and reports the share of prompt tokens
that came from the cache next to Belady's offline optimum for the same pool size. The first line
checks the replay: under the recorded settings it must give the recorded hit rate exactly.
"""
from __future__ import annotations

import argparse
import os
import sys

from rich.table import Table
from rich.text import Text

from kvplay.engine.config import ISOLATION_MODES
from kvplay.inert import inert
from kvplay.options import KvplayError, add_db_arg, check_output_file, pyplot, save_plot
from kvplay.sessions.report import console, print_json
from kvplay.sessions.store import open_db
from kvplay.sessions.traces import SIM_POLICIES, Trace, read_trace_file, session_trace


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SESSION_ID|TRACE", help="a recorded session (id or unique prefix) or a trace file")
    parser.add_argument("--num-blocks", nargs="+", default=None, metavar="N",
                        help="pool sizes to try (default: around the recorded size)")
    parser.add_argument("--policy", default=",".join(SIM_POLICIES), help=f"comma list of {', '.join(SIM_POLICIES)}")
    parser.add_argument("--isolation", default=None, help=f"comma list of {', '.join(ISOLATION_MODES)} (default: recorded)")
    parser.add_argument("--json", action="store_true", help='{"recorded": …, "results": […]} on stdout')
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="save hit rate vs pool size per policy")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per hash id of a Mooncake trace file (default 16)")
    add_db_arg(parser)


def _list(text: str, allowed, flag: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in allowed]
    if bad or not out:
        raise KvplayError(f"{flag} {text!r}: choose from {', '.join(allowed)}")
    return list(dict.fromkeys(out))


def _sizes(values: list[str] | None) -> list[int] | None:
    """The --num-blocks values, checked (None: not given)."""
    if not values:
        return None
    out = []
    for v in values:
        for part in str(v).split(","):
            try:
                n = int(part)
            except ValueError:
                n = 0
            if n <= 0:
                raise KvplayError(f"--num-blocks {part!r}: give positive integers")
            out.append(n)
    return sorted(set(out))


def load_source(source: str, db_path: str | None, block_size: int = 16) -> tuple[Trace, str | None]:
    """A trace file when `source` names a file, else a session in the sessions DB; with the
    line naming a trace file's first bad record (its good records are still simulated)."""
    if not os.path.isfile(source) and ("." in source or "/" in source or os.sep in source):
        # a session id is letters and digits: this names a file (kvplay simulate nope.jsonl)
        what = "is a directory, not a trace file" if os.path.isdir(source) else "no such file"
        raise KvplayError(f"{source}: {what} (give a trace file or a session id from `kvplay sessions`)")
    if os.path.isfile(source):
        read = read_trace_file(source, block_size=block_size)
        return read.trace, read.error

    db = open_db(db_path, create=False)
    try:
        return session_trace(db, source), None
    finally:
        db.close()


def plot(results, trace: Trace, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    isos = sorted({r.isolation for r in results})
    styles = ["-", "--", ":", "-."]
    for i, p in enumerate(dict.fromkeys(r.policy for r in results)):
        for k, iso in enumerate(isos):
            pts = sorted((r.num_blocks, r.hit_rate * 100) for r in results if r.policy == p and r.isolation == iso)
            label = p if len(isos) == 1 else f"{p} ({iso})"
            ax.plot([x for x, _ in pts], [y for _, y in pts], styles[k % len(styles)], marker="o", color=f"C{i}",
                    label=label, linewidth=2.4 if p == "belady" else 1.4)
    c = trace.config
    if trace.recorded_hit_rate is not None:
        ax.scatter([c.num_blocks], [trace.recorded_hit_rate * 100], s=90, facecolors="none", edgecolors="black",
                   zorder=5, label=f"recorded ({c.eviction})")
    ax.set_xlabel(f"pool size (blocks of {c.block_size} tokens)")
    ax.set_ylabel("prompt tokens from the cache (%)")
    ax.set_title(f"kvplay simulate: {trace.source}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_plot(lambda p: fig.savefig(p, dpi=120), path)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    policies = _list(args.policy, SIM_POLICIES, "--policy")
    check_output_file(args.plot, "--plot", ".png")
    if args.block_size <= 0:
        raise KvplayError(f"--block-size must be positive (got {args.block_size})")
    trace, bad = load_source(args.source, args.db, args.block_size)
    rc = _report(args, trace, policies)
    if bad:
        print(f"kvplay: error: {inert(bad)} (simulated the records before it)", file=sys.stderr)
        return 2
    return rc


def _report(args, trace: Trace, policies: list[str]) -> int:
    # Lazy, the command boundary: the simulator runs the engine's scheduler, whose import (torch,
    # transformers) takes 2.4 s niced on the 2-core machine; `kvplay simulate --help`, a bad flag
    # or a bad trace file answer without it.
    from kvplay.sessions.simulate import default_sizes, headline, simulate, simulate_grid

    c = trace.config
    isolations = _list(args.isolation, ISOLATION_MODES, "--isolation") if args.isolation else [c.isolation]
    sizes = _sizes(args.num_blocks) or default_sizes(trace)
    err = sys.stderr

    def progress(i: int, total: int, what: str) -> None:
        if err.isatty():
            print(f"\rkvplay: simulating {i + 1}/{total}: {what} …\033[K", end="", file=err, flush=True)

    own = simulate(trace)  # the recorded settings: must reproduce the recorded hits
    own_opt = simulate(trace, policy="belady")
    results = simulate_grid(trace, sizes, policies, isolations, progress)
    if err.isatty():
        print("\r\033[K", end="", file=err)
    recorded = trace.recorded_hit_rate
    if args.json:
        print_json({"recorded": {"policy": c.eviction, "num_blocks": c.num_blocks,
                                 "hit_rate": None if recorded is None else round(recorded, 6)},
                    "results": [r.to_dict() for r in results]})
        return 0

    con = console()
    n = len(trace.requests)
    con.print(Text.assemble((inert(trace.source), "bold"), f": {n} requests, {trace.prompt_tokens()} prompt tokens; "
                            f"recorded {c.eviction} on {c.num_blocks} blocks of {c.block_size} tokens, isolation "
                            f"{c.isolation}"), highlight=False)
    if recorded is not None and not trace.source.startswith("session "):
        con.print(f"the server's events show {recorded:.1%} of prompt tokens reused ({trace.recorded_hit_tokens}/"
                  f"{trace.recorded_query_tokens}); replayed in kvplay's pool as set here: {own.hit_rate:.1%}",
                  highlight=False)
    elif recorded is not None:
        end = getattr(trace, "final_settings", None) or {}
        changed = [f"{k} {getattr(c, k)} → {v}" for k, v in end.items() if v is not None and v != getattr(c, k)]
        if changed:
            con.print(f"[yellow]settings changed during the session ({', '.join(changed)}); the replay uses the "
                      "initial ones, so it cannot match the live run exactly[/yellow]", highlight=False)
        same = own.hit_tokens == trace.recorded_hit_tokens and own.query_tokens == trace.recorded_query_tokens
        verdict = "[green]reproduces[/green]" if same else "[yellow]differs[/yellow]"
        con.print(f"replayed under its recorded settings: {own.hit_rate:.1%} ({own.hit_tokens}/{own.query_tokens}); "
                  f"recorded {recorded:.1%} ({trace.recorded_hit_tokens}/{trace.recorded_query_tokens}): {verdict}",
                  highlight=False)
    table = Table(header_style="bold", title="prompt tokens from the cache (share of the optimum)")
    table.add_column("blocks", justify="right")
    if len(isolations) > 1:
        table.add_column("isolation")
    for p in policies:
        table.add_column(p, justify="right")
    for iso in isolations:
        for size in sizes:
            row = [str(size)] + ([iso] if len(isolations) > 1 else [])
            for p in policies:
                r = next(r for r in results if r.num_blocks == size and r.isolation == iso and r.policy == p)
                cell = f"{r.hit_rate:.1%}"
                if p != "belady":
                    cell += "" if r.of_optimum is None else f" ({r.of_optimum:.0%})"
                row.append(cell)
            table.add_row(*row)
    con.print(table)
    con.print(headline(own, own_opt), highlight=False)
    if args.plot:
        plot(results, trace, args.plot)
    return 0
