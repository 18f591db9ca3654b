"""The statistics, verdicts and plot of `kvplay audit` (labs/audit.py runs the procedure).

Per level (and per sweep value), over the attacker's probes recorded in the sessions DB:

- **timing** (the client's time to the first token; the server's own time too where it reports
  one: kvplay serve's ``kvplay.ttft_ms``, an ``openai-processing-ms`` header): Gu et al.'s
  one-sided two-sample KS test (hits faster) at α (1e-8), plus a **direction check** (median
  hit below median miss: CacheProbe's two-sided test called a cache where hits were slower),
  average precision and ROC AUC of "faster means hit" with bootstrap intervals, the share of
  hits faster than the fastest miss, median/mean/std per class;
- **cached_tokens** (CacheProbe's metadata detector): a probe is flagged when the server reports
  ``usage.prompt_tokens_details.cached_tokens`` of at least `cached_fraction` of the shared
  prefix (rounded down to whole blocks where the block size is known: a cache holds whole
  blocks); flags on hit vs miss probes get a one-sided Fisher exact test at the same α;
- the **power** of a run that found nothing: the smallest CDF gap its probe counts can call at α,
  as a normal shift and an AUC (stats.ks_detectable).

A level's verdict is one line: detected when either channel is significant at α (timing only in
the right direction), else "not detected at this power".
"""
from __future__ import annotations

import math
import statistics

from . import stats
from .common import LabResult, Table, pyplot

LEVEL_WORDS = {"user": "cached for one key", "org": "shared across keys of one organisation",
               "global": "shared across organisations' keys"}


def _summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs) if xs else None, "mean": statistics.fmean(xs) if xs else None,
            "std": statistics.stdev(xs) if len(xs) > 1 else None, "min": min(xs) if xs else None}


def timing(hit: list[float], miss: list[float], alpha: float, confidence: float, seed: int = 0) -> dict:
    """One timing channel: the KS test (hits faster), its direction, AP and AUC with intervals."""
    out = {"n_hit": len(hit), "n_miss": len(miss), "hit": _summary(hit), "miss": _summary(miss),
           "samples": {"hit": list(hit), "miss": list(miss)}}
    if len(hit) < 2 or len(miss) < 2:
        return {**out, "ks_d": None, "ks_p": None, "direction_ok": None, "ap": None, "ap_lo": None, "ap_hi": None,
                "auc": None, "auc_lo": None, "auc_hi": None, "faster_than_fastest_miss": None, "detected": False}
    d, p = stats.ks_less(hit, miss)
    direction = out["hit"]["median"] < out["miss"]["median"]
    ap, lo, hi = stats.ap_ci([-x for x in hit], [-x for x in miss], level=confidence, seed=seed)
    auc, alo, ahi = stats.auc_ci(miss, hit, level=confidence, seed=seed)
    fastest = min(miss)
    return {**out, "ks_d": d, "ks_p": p, "direction_ok": direction, "ap": ap, "ap_lo": lo, "ap_hi": hi,
            "auc": auc, "auc_lo": alo, "auc_hi": ahi,
            "faster_than_fastest_miss": sum(x < fastest for x in hit) / len(hit),
            "detected": bool(p < alpha and direction)}


def cached_channel(hit: list, miss: list, threshold: float, alpha: float, confidence: float, seed: int = 0) -> dict:
    """CacheProbe's detector: flagged = cached_tokens reported and >= threshold (and > 0)."""
    h = [c for c in hit if c is not None]
    m = [c for c in miss if c is not None]
    out = {"reported": bool(h or m), "threshold": threshold, "n_hit": len(h), "n_miss": len(m),
           "unreported": len(hit) - len(h) + len(miss) - len(m)}
    if not h or not m:
        return {**out, "hits_flagged": None, "misses_flagged": None, "p": None, "ap": None, "ap_lo": None,
                "ap_hi": None, "median_hit": None, "detected": False}
    flag = lambda c: c > 0 and c >= threshold  # noqa: E731
    fh, fm = sum(map(flag, h)), sum(map(flag, m))
    p = stats.fisher_greater(fh, len(h), fm, len(m))
    ap, lo, hi = stats.ap_ci(h, m, level=confidence, seed=seed) if len(h) > 1 and len(m) > 1 else (
        stats.average_precision(h, m), float("nan"), float("nan"))
    return {**out, "hits_flagged": fh, "misses_flagged": fm, "p": p, "ap": ap, "ap_lo": lo, "ap_hi": hi,
            "median_hit": statistics.median(h), "median_miss": statistics.median(m),
            "detected": bool(p < alpha and fh > fm)}


def shared_tokens(shared_letters: int, tok: dict) -> int:
    """Tokens a hit prompt shares with the victim's: the prompt's fixed head (a chat template,
    a BOS) plus per_letter tokens a letter with its separator (one when the tokenization check
    was not possible)."""
    return (tok.get("head") or 0) + (tok.get("per_letter") or 1) * shared_letters


def analyze(rows: list[dict], p, tok: dict, block_size: int | None) -> dict:
    """The report's numbers from the recorded requests (`ProbeLog.probes()` rows)."""
    groups = []
    values = p.sweep_values if p.sweep else [None]
    for lv in p.levels:
        for v in values:
            att = [r for r in rows if r["probe"].get("role") == "attacker" and r["probe"].get("level") == lv
                   and r["probe"].get("value") == v and r["error"] is None and r["ttft_ms"] is not None]
            hits = [r for r in att if r["probe"].get("kind") == "hit"]
            misses = [r for r in att if r["probe"].get("kind") == "miss"]
            controls = [r for r in att if r["probe"].get("kind") == "control"]
            n, frac = p.shape(v)
            keep = min(n, int(math.floor(frac * n + 0.5)))
            tokens = shared_tokens(keep, tok)
            cacheable = (tokens // block_size) * block_size if block_size else tokens
            threshold = p.cached_fraction * (cacheable if cacheable > 0 else tokens)
            g = {"level": lv, "value": v, "prompt_letters": n, "prefix_fraction": frac, "shared_letters": keep,
                 "shared_tokens": tokens, "shared_blocks": tokens // block_size if block_size else None,
                 "client": timing([r["probe"]["client_ms"] for r in hits], [r["probe"]["client_ms"] for r in misses],
                                  p.alpha, p.confidence, p.seed),
                 "cached": cached_channel([r["cached_tokens"] for r in hits], [r["cached_tokens"] for r in misses],
                                          threshold, p.alpha, p.confidence, p.seed),
                 "power": stats.ks_detectable(len(hits), len(misses), p.alpha)}
            # A/A: the hit procedure's steps with an unrelated prompt, against the misses: what the
            # procedure alone (a victim request just before, drift) separates
            g["control"] = ({**timing([r["probe"]["client_ms"] for r in controls],
                                      [r["probe"]["client_ms"] for r in misses], p.alpha, p.confidence, p.seed),
                             "cached_flags": sum(1 for r in controls if (r["cached_tokens"] or 0) > 0
                                                 and r["cached_tokens"] >= threshold)}
                            if controls else None)
            if g["control"] is not None and g["control"]["detected"]:
                g["client"]["detected"] = False  # the procedure separates on its own: not the cache's doing
            sh = [r["probe"].get("server_ms") for r in hits]
            sm = [r["probe"].get("server_ms") for r in misses]
            g["server"] = (timing(sh, sm, p.alpha, p.confidence, p.seed)
                           if sh and sm and all(x is not None for x in sh + sm) else None)
            g["detected"] = bool(g["client"]["detected"] or (g["server"] or {}).get("detected")
                                 or g["cached"]["detected"])
            g["verdict"] = verdict_line(g, p)
            groups.append(g)
    return {"groups": groups}


def _p(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2g}"


def _ap(c: dict) -> str:
    if c.get("ap") is None or (isinstance(c["ap"], float) and math.isnan(c["ap"])):
        return "AP —"
    return f"AP {c['ap']:.2f} {stats.interval(c['ap_lo'], c['ap_hi'])}"


def _cached_phrase(c: dict) -> str:
    if not c["reported"]:
        return "cached_tokens: not reported"
    if c["hits_flagged"] is None:
        return "cached_tokens: reported on too few probes"
    return (f"cached_tokens: {c['hits_flagged']}/{c['n_hit']} hits vs {c['misses_flagged']}/{c['n_miss']} misses "
            f"at >= {c['threshold']:.0f} tokens (p = {_p(c['p'])})")


def _power_phrase(g: dict, p) -> str:
    pw = g["power"]
    n, m = g["client"]["n_hit"], g["client"]["n_miss"]
    if pw["d"] is None:
        return (f"{n} + {m} probes cannot reach p < {p.alpha:g} even perfectly separated "
                f"(floor {pw['floor_p']:.1g}): raise --probes")
    if pw["shift_sd"] is None:
        return f"{n} + {m} probes call only perfectly separated samples at α = {p.alpha:g}"
    return (f"{n} + {m} probes call a CDF gap D >= {pw['d']:.2f} at α = {p.alpha:g}, "
            f"a normal shift of {pw['shift_sd']:.2f} σ, AUC {pw['auc']:.2f}")


def where(g: dict) -> str:
    """"global" or "global, prefix fraction 0.5" / "global, 250 letters": a group's name."""
    if g["value"] is None:
        return g["level"]
    return f"{g['level']}, {g['shared_letters']} of {g['prompt_letters']} letters shared"


def verdict_line(g: dict, p) -> str:
    line = _verdict(g, p)
    ctl = g.get("control")
    if ctl is None:
        return line
    s = (f" Control (the victim sends, the attacker's prompt unrelated, {ctl['n_hit']} probes): KS p = "
         f"{_p(ctl['ks_p'])}, {_ap(ctl)} against the misses")
    if ctl["detected"]:
        s += ": the procedure alone separates, so timing is not counted as the cache's"
    elif ctl["auc_lo"] is not None and ctl["auc_lo"] == ctl["auc_lo"] and (ctl["auc_lo"] > 0.5 or ctl["auc_hi"] < 0.5):
        # AUC, not AP: chance is exactly 0.5 for the AUC and its bootstrap holds its level; AP's
        # chance is above 0.5 in small samples (0.53 for 30 + 30) and its percentile interval
        # misses 0.5 about twice as often as its level says (stats.ap_ci)
        s += f": the procedure alone shifts the times a little (ROC AUC {ctl['auc']:.2f} " \
             f"{stats.interval(ctl['auc_lo'], ctl['auc_hi'])} misses 0.5)"
    return line + s + "."


def _verdict(g: dict, p) -> str:
    c, ch = g["client"], g["cached"]
    words = LEVEL_WORDS[g["level"]]
    med = (f"median hit {c['hit']['median']:.1f} vs miss {c['miss']['median']:.1f} ms"
           if c["hit"]["median"] is not None and c["miss"]["median"] is not None else "no probes")
    head = f"{where(g)}: {words}: "
    if c["detected"]:
        s = f"{head}detected, p = {_p(c['ks_p'])}, {_ap(c)} (client time, {med}); {_cached_phrase(ch)}"
        if ch["reported"] and ch["hits_flagged"] == 0:
            s += " — the server's counter shows none of it"
        return s + "."
    if ch["detected"]:
        return (f"{head}detected by cached_tokens ({ch['hits_flagged']}/{ch['n_hit']} hits vs "
                f"{ch['misses_flagged']}/{ch['n_miss']} misses, p = {_p(ch['p'])}); timing does not separate at "
                f"this power (p = {_p(c['ks_p'])}, {_ap(c)}, {med}).")
    if g["server"] and g["server"]["detected"]:
        return (f"{head}detected in the server's time, p = {_p(g['server']['ks_p'])}, {_ap(g['server'])}; "
                f"not in the client's (p = {_p(c['ks_p'])}); {_cached_phrase(ch)}.")
    if c["ks_p"] is not None and c["ks_p"] < p.alpha and not c["direction_ok"]:
        return (f"{head}not detected: timing differs (p = {_p(c['ks_p'])}) but hits are slower ({med}), which no "
                f"cache hit does; {_cached_phrase(ch)}.")
    return (f"{head}not detected at this power (p = {_p(c['ks_p'])}, {_ap(c)}, {med}; {_power_phrase(g, p)}); "
            f"{_cached_phrase(ch)}.")


# --- the result as a lab result (tables, JSON) and a plot -----------------------------------------------
def result(report: dict, p, info: dict, elapsed: float) -> LabResult:
    groups = report["groups"]
    rows = []
    for g in groups:
        for name, c in (("client time", g["client"]), ("server time", g["server"])):
            if c is None:
                continue
            rows.append([where(g), name, c["n_hit"], c["n_miss"], c["hit"]["median"], c["miss"]["median"],
                         c["ks_p"], "yes" if c["direction_ok"] else "no" if c["direction_ok"] is not None else "—",
                         c["ap"], stats.interval(c["ap_lo"], c["ap_hi"]), c["auc"], c["faster_than_fastest_miss"],
                         "detected" if c["detected"] else "not detected"])
        if g.get("control") is not None:
            c = g["control"]
            rows.append([where(g), "control vs miss (A/A)", c["n_hit"], c["n_miss"], c["hit"]["median"],
                         c["miss"]["median"], c["ks_p"],
                         "yes" if c["direction_ok"] else "no" if c["direction_ok"] is not None else "—",
                         c["ap"], stats.interval(c["ap_lo"], c["ap_hi"]), c["auc"], c["faster_than_fastest_miss"],
                         "separates" if c["detected"] else "does not separate"])
        ch = g["cached"]
        rows.append([where(g), "cached_tokens", ch["n_hit"], ch["n_miss"], ch.get("median_hit"), ch.get("median_miss"),
                     ch["p"], "—", ch["ap"], stats.interval(ch["ap_lo"], ch["ap_hi"]) if ch["ap"] is not None else "—",
                     None, None, ("detected" if ch["detected"] else "not detected") if ch["reported"] else "not reported"])
    tables = [Table(f"Hit vs miss probes ({p.confidence:.0%} intervals; timing: one-sided KS, hits faster; "
                    f"cached_tokens: Fisher exact on flags; α = {p.alpha:g})",
                    ["level", "channel", "hits", "misses", "median hit", "median miss", "p", "hits faster",
                     "AP", "AP interval", "ROC AUC", "hits < fastest miss", "at α"], rows)]
    if p.sweep:
        tables.append(Table(f"Sweep of {p.sweep} (level {p.levels[0]}; block size {info.get('block_size') or '?'})",
                            ["letters", "shared letters", "shared tokens", "shared blocks", "AP (client)", "interval",
                             "KS p", "cached flags hit/miss", "verdict"],
                            [[g["prompt_letters"], g["shared_letters"], g["shared_tokens"], g["shared_blocks"],
                              g["client"]["ap"], stats.interval(g["client"]["ap_lo"], g["client"]["ap_hi"]),
                              g["client"]["ks_p"],
                              f"{g['cached']['hits_flagged']}/{g['cached']['misses_flagged']}"
                              if g["cached"]["hits_flagged"] is not None else "—",
                              "detected" if g["detected"] else "not detected"] for g in groups]))
    lines = [g["verdict"] for g in groups] if not p.sweep else [sweep_line(groups)]
    data = {"params": info["params"], "server": info["server"], "tokenization": info["tokenization"],
            "block_size": info.get("block_size"), "block_size_from": info.get("block_size_from"),
            "session": info.get("session"), "requests": info.get("requests"), "groups": groups}
    return LabResult("audit", "\n".join(lines), tables, data, info["server"].get("label", ""),
                     {"url": p.url, "endpoint": p.endpoint}, elapsed)


def sweep_line(groups: list[dict]) -> str:
    """The sweep in one line: AP at every point, from the most shared to the least, and which
    channel called it."""
    pts = sorted(groups, key=lambda g: -g["shared_tokens"])
    blocks = bool(pts) and pts[0]["shared_blocks"] is not None

    def at(g):
        n = g["shared_blocks"] if blocks else g["shared_tokens"]
        unit = ("block" if n == 1 else "blocks") if blocks else ("token" if n == 1 else "tokens")
        by = [name for name, c in (("timing", g["client"]), ("cached_tokens", g["cached"])) if c["detected"]]
        return f"{n} {unit} ({g['shared_letters']} letters): AP {g['client']['ap']:.2f}" + (
            f", detected by {' and '.join(by)}" if by else "")

    lv = pts[0]["level"] if pts else "?"
    return (f"{lv}: AP of the client time against the shared prefix (chance 0.5) — "
            + "; ".join(at(g) for g in pts if g["client"]["ap"] is not None) + ".")


def plot(res: LabResult, path: str) -> None:
    """Hit vs miss client-time CDFs per level; with a sweep, AP (and its interval) against the
    shared blocks (Gu et al.'s Figure 5 shape) beside the CDFs at the largest shared prefix."""
    plt = pyplot()  # matplotlib.pyplot: its ticker classes too (plt.FuncFormatter, …)
    groups = res.data["groups"]
    sweep = res.data["params"].get("sweep")
    cdf_groups = groups if not sweep else [max(groups, key=lambda g: g["shared_tokens"])]
    n = len(cdf_groups) + (1 if sweep else 0)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4), squeeze=False)
    axes = axes[0]
    if sweep:
        ax = axes[0]
        blocks = groups[0]["shared_blocks"] is not None
        xs = [g["shared_blocks"] if blocks else g["shared_tokens"] for g in groups]
        order = sorted(range(len(groups)), key=lambda i: xs[i])
        for key, label in (("client", "client time"), ("cached", "cached_tokens")):
            pts = [(xs[i], groups[i][key]) for i in order if groups[i][key]["ap"] is not None]
            if not pts:
                continue
            x = [a for a, _ in pts]
            y = [c["ap"] for _, c in pts]
            lo = [max(c["ap"] - c["ap_lo"], 0) if c["ap_lo"] == c["ap_lo"] else 0 for _, c in pts]
            hi = [max(c["ap_hi"] - c["ap"], 0) if c["ap_hi"] == c["ap_hi"] else 0 for _, c in pts]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=label)
            if key == "client":  # which point is which: the letters shared
                for i in order:
                    if groups[i]["client"]["ap"] is not None:
                        ax.annotate(f"{groups[i]['shared_letters']}", (xs[i], groups[i]["client"]["ap"]),
                                    textcoords="offset points", xytext=(6, -10), fontsize=7, color="C0")
        ax.axhline(0.5, color="grey", ls=":", label="chance")
        ax.set(xlabel=f"shared prefix ({'whole blocks' if blocks else 'tokens'}; labels: letters shared)",
               ylabel=f"average precision ({res.data['params'].get('confidence', 0.95):.0%} interval)",
               ylim=(0.3, 1.05),
               title=f"AP vs shared prefix ({sweep} sweep)")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(-0.3, max(xs) * 1.5 + 1)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.legend()
    for ax, g in zip(axes[1:] if sweep else axes, cdf_groups):
        for kind, colour in (("hit", "C0"), ("miss", "C1")):
            xs = sorted(g["client"]["samples"][kind])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=colour,
                        label=f"{kind} (n={len(xs)})")
        if g.get("control") is not None:
            xs = sorted(g["control"]["samples"]["hit"])
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color="grey", ls="--",
                    label=f"control, A/A (n={len(xs)})")
        c = g["client"]
        shared = (f"{g['shared_blocks']} blocks" if g["shared_blocks"] is not None
                  else f"{g['shared_tokens']} tokens")
        ax.set(xlabel="client time to first token (ms)", ylabel="fraction of probes", ylim=(0, 1.02),
               title=f"{g['level']}, {shared} shared\nKS p = {_p(c['ks_p'])}, {_ap(c)}")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(plt.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
