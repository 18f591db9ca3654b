"""Showing a bench report: rich tables, and a matplotlib (Agg) figure."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvplay.options import pyplot
from kvplay.sessions.report import console as make_console
from kvplay.sessions.report import fmt, mib

from .metrics import COMPARED
from .scale import scale_lines


def _f(v, spec: str = ".1f") -> str:
    """A bench cell: `v` formatted by `spec`, "–" when missing (sessions.report.fmt)."""
    return fmt(v, spec, none="–")


def _load(v) -> str:
    """os.getloadavg() as "1.29 1.03 1.54" (1, 5, 15 minutes)."""
    return "–" if not v else " ".join(f"{x:.2f}" for x in v)


def workload_table(w: dict) -> Table:
    s = w["workload"]
    t = Table(title=f"{s['name']}: {s['description']} ({s['requests']} requests, {s['prompt_tokens']} prompt tokens, "
                    f"system prompt {s['system_tokens']} tokens)", title_justify="left")
    for col in ("peer", "wall s", "TTFT cold p50/p95 ms", "TTFT warm p50/p95 ms", "decode tok/s",
                "prompt computed / reused", "hit rate", "peak KV MiB", "wall x faster"):
        t.add_column(col, justify="left" if col == "peer" else "right")
    for key, p in w["peers"].items():
        if p.get("unavailable"):
            t.add_row(key, p["unavailable"], *[""] * 7)
            continue
        reused = p.get("reused_tokens")
        t.add_row(
            key, _f(p["wall_s"], ".2f"),
            f"{_f(p['ttft_cold_p50_ms'], '.0f')} / {_f(p['ttft_cold_p95_ms'], '.0f')}",
            f"{_f(p['ttft_warm_p50_ms'], '.0f')} / {_f(p['ttft_warm_p95_ms'], '.0f')}",
            _f(p["decode_tok_s"]),
            f"{_f(p.get('computed_tokens'), 'd')} / {_f(reused, 'd')}",
            _f(p.get("hit_rate"), ".0%"), mib(p.get("peak_kv_bytes"), unit=False),
            "(kvplay)" if key == "kvplay" else _f(w["speedups"].get(key), ".2f"),
        )
    return t


def ratio_table(w: dict) -> Table:
    t = Table(title=f"{w['workload']['name']}: kvplay / peer (times: < 1 is better for kvplay; tok/s: > 1)",
              title_justify="left")
    t.add_column("peer")
    short = {"wall_s": "wall", "ttft_cold_p50_ms": "TTFT cold p50", "ttft_warm_p50_ms": "TTFT warm p50",
             "ttft_warm_p95_ms": "TTFT warm p95", "decode_tok_s": "decode tok/s", "throughput_tok_s": "tok/s overall",
             "computed_tokens": "computed tokens", "peak_kv_bytes": "peak KV"}
    for key in COMPARED:
        t.add_column(short.get(key, key), justify="right")
    for peer, r in w["ratios"].items():
        if w["peers"][peer].get("unavailable"):
            t.add_row(peer, *["–"] * len(COMPARED))
            continue
        t.add_row(peer, *[_f(r.get(k), ".2f") for k in COMPARED])
    return t


def targets_table(report: dict) -> Table:
    t = Table(title="targets", title_justify="left")
    for col in ("target", "measured", "goal", "met"):
        t.add_column(col, justify="left" if col == "target" else "right")
    for tg in report["targets"]:
        goal = ("≤ " if tg["smaller_is_better"] else "≥ ") + f"{tg['threshold']:g}"
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "n/a"}[tg["met"]]
        v = tg["value"]
        shown = _f(v, ".2f") if v is None or abs(v) >= 0.1 else f"{v:.3g}"  # e.g. a stats() cost of 0.004 ms
        t.add_row(tg["name"] + (f" ({tg['detail']})" if tg["detail"] else ""), shown, goal, met)
    return t


def legend(report: dict) -> Table:
    t = Table(title="peers", title_justify="left", show_header=False)
    seen = {}
    for w in report["workloads"]:
        for key, p in w["peers"].items():
            seen.setdefault(key, p["label"])
    for key, label in seen.items():
        t.add_row(key, label)
    return t


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or make_console(width=140)
    console.print(f"[bold]kvplay bench[/] · {report['model']} on {report['device']} ({report['dtype']}) · "
                  f"{report['cpu_count']} CPUs, torch threads {report['torch_threads']} · load avg "
                  f"{_load(report['load_avg_start'])} → {_load(report.get('load_avg_end'))} · {report['elapsed_s']:.0f} s"
                  + (" · --quick" if report["quick"] else ""))
    console.print(legend(report))
    for w in report["workloads"]:
        console.print(workload_table(w))
        if w.get("ratios"):
            console.print(ratio_table(w))
        if w.get("kvplay_warm_cold_ttft") is not None:
            console.print(f"kvplay warm/cold TTFT p50: {w['kvplay_warm_cold_ttft']:.2f}")
        for note in w["workload"].get("notes", []):
            console.print(f"note: {note}")
        loads = [f"{k} {p['load_1min'][0]:.1f}→{p['load_1min'][1]:.1f}" for k, p in w["peers"].items()
                 if p.get("load_1min") and None not in p["load_1min"]]
        if loads:
            console.print("1-minute load average before→after each peer: " + ", ".join(loads))
    probe = report.get("decode_probe")
    if probe:
        console.print(f"latency probe: kvplay one request alone, TTFT cold {_f(probe['kvplay_alone_cold_ttft_ms'], '.0f')}"
                      f" ms, warm {_f(probe['kvplay_alone_warm_ttft_ms'], '.0f')} ms")
        console.print(f"decode probe: kvplay 1 user {_f(probe['kvplay_1_user_tok_s'])} tok/s, "
                      f"{probe['users']} users {_f(probe['kvplay_n_users_tok_s'])} tok/s aggregate; "
                      f"HF generate + DynamicCache 1 user {_f(probe['hf_1_user_tok_s'])} tok/s")
    if report.get("targets"):
        console.print(targets_table(report))


def print_scale_report(report: dict, console: Console | None = None) -> None:
    """The `scale` workload: bench/scale.py's lines, then its targets."""
    console = console or make_console(width=140)
    console.print(f"[bold]kvplay bench --workload scale[/] · {report['cpu_count']} CPUs, torch threads "
                  f"{report['torch_threads']} · load avg {_load(report['load_avg_start'])} → {_load(report.get('load_avg_end'))} · "
                  f"{report['elapsed_s']:.0f} s")
    for line in scale_lines(report["scale"]):
        console.print(line, markup=False, highlight=False)
    console.print(targets_table(report))


def plot_report(report: dict, path: str) -> None:
    """Bars of wall time and warm TTFT p50 per peer, one row per workload."""
    plt = pyplot()
    ws = report["workloads"]
    fig, axes = plt.subplots(len(ws), 3, figsize=(15, 3.6 * len(ws)), squeeze=False)
    for row, w in zip(axes, ws):
        peers = {k: p for k, p in w["peers"].items() if not p.get("unavailable")}
        names = list(peers)
        colors = ["tab:green" if n.startswith("kvplay") else "tab:gray" for n in names]
        for ax, key, title in zip(row, ("wall_s", "ttft_warm_p50_ms", "decode_tok_s"),
                                  ("wall time (s)", "warm TTFT p50 (ms)", "decode tok/s (aggregate)")):
            vals = [peers[n].get(key) or 0 for n in names]
            ax.barh(names, vals, color=colors)
            ax.set_title(f"{w['workload']['name']}: {title}", fontsize=10)
            ax.invert_yaxis()
            for i, v in enumerate(vals):
                ax.text(v, i, f" {v:.1f}", va="center", fontsize=8)
    fig.suptitle(f"kvplay bench · {report['model']} on {report['device']}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
