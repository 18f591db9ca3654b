"""`kvplay audit URL`: is this endpoint's prompt cache shared between API keys? (labs/audit.py)"""
from __future__ import annotations

import argparse
import os
import sys

from kvplay.labs.common import Progress, emit
from kvplay.options import KvplayError, add_db_arg, check_output_file

DESCRIPTION = """\
Audit an OpenAI-compatible endpoint (vLLM, SGLang, kvplay serve, a gateway, a hosted API) for
prompt caching shared between API keys, by Gu et al.'s procedure ("Auditing Prompt Caching in
Language Model APIs", ICML 2025): prompts of random letters (one token each); a hit procedure
(the victim's key sends a prompt, the attacker's key sends one sharing its first
--prefix-fraction) and a miss procedure (a fresh prompt), --probes of each in random order,
max_tokens=1; a one-sided KS test of the attacker's times (hits faster) at --alpha, with a
direction check, average precision and ROC AUC, and CacheProbe's second detector on
usage.prompt_tokens_details.cached_tokens.

Defaults are scaled for a CPU server: vLLM serving SmolLM2-135M on two busy cores answered a
cold 500-token probe in ~1.5 s and a 1000-token one in ~3.3 s (the paper's 5000 would take
tens of seconds each, and exceed the 2048-token context scripts/vllm-cpu.sh gives it), so
500-letter prompts, 50 + 50 probes and 0.1 s between requests give a verdict in about three
minutes; 50 + 50 still call a CDF gap of 0.61 at α 1e-8 (a normal shift of 1.7 σ), and a cache
hit there is ~7x faster. The paper's values (5000 letters, 250 + 250 probes, 1 s) are --paper;
a flag given with it wins.

Keys: --key K (repeatable) or --key-file F (one per line), the attacker's first; --level user
uses it as the victim's too; org and global take the next keys, in the order the levels are
named (two keys of one organisation; keys of two organisations). Without a key, $OPENAI_API_KEY.
Every request is recorded in the sessions DB as it ends (kvplay sessions / show); an interrupted
run keeps them, and --resume ID continues it.
"""


def _floats(text: str, flag: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise KvplayError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not out:
        raise KvplayError(f"{flag}: no value given")
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("url", nargs="?", metavar="URL", help="the server, http://HOST:PORT (its /v1 API); "
                        "optional with --resume")
    g = parser.add_argument_group("keys and levels")
    g.add_argument("--key", action="append", default=[], metavar="K",
                   help="an API key (repeatable): the attacker's first, then the victims' (see above)")
    g.add_argument("--key-file", metavar="F", help="API keys, one per line (# comments), after any --key: "
                   "keeps them off the command line")
    g.add_argument("--level", default=None, metavar="user|org|global",
                   help="what to audit, comma-separated: user (one key: the cache of a key), org (two keys of "
                   "one organisation), global (two unrelated keys) (default user)")
    g.add_argument("--model", metavar="NAME", help="the model to send (default: the one the server lists first)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                   help="/v1/completions (default) or /v1/chat/completions (for chat-only APIs; the chat "
                   "template's head is shared by every probe)")
    g = parser.add_argument_group("the procedure (Gu et al.; the paper's value in brackets)")
    g.add_argument("--paper", action="store_true", help="the paper's values: --prompt-length 5000 --probes 250 "
                   "--delay 1 (about 20 min on a hosted API; hours on a CPU server)")
    g.add_argument("--prompt-length", type=int, metavar="N", help="letters per prompt, one token each "
                   "(default 500 [5000]: a CPU server's cold 5000-token prefill takes tens of seconds)")
    g.add_argument("--prefix-fraction", type=float, metavar="F", help="share of the victim's prompt a hit "
                   "probe keeps; the next letter is forced to differ (default 0.95 [0.95])")
    g.add_argument("--victim-sends", type=int, metavar="V", help="times the victim sends its prompt before "
                   "the attacker probes: 1, or 5 or 25 where routing spreads requests over caches (default 1 [1])")
    g.add_argument("--probes", type=int, metavar="N", help="hit procedures and miss procedures, each, per level "
                   "and sweep value (default 50 [250]; 50 + 50 call a CDF gap of 0.61 at α 1e-8, 250 + 250 one of 0.27)")
    g.add_argument("--delay", type=float, metavar="S", help="seconds to wait after every request "
                   "(default 0.1 [1])")
    g.add_argument("--control", action="store_true", default=None,
                   help="also run --probes A/A procedures: the victim sends, then the attacker sends a prompt "
                   "sharing nothing with it; their times against the misses show what the procedure alone "
                   "separates (a request just before, drift), and timing counts only if they do not")
    g.add_argument("--seed", type=int, default=None, metavar="N", help="seed of the procedures' order (default 0); prompts "
                   "are fresh every run, so a second run never finds the first one's prompts cached")
    g = parser.add_argument_group("statistics")
    g.add_argument("--alpha", type=float, metavar="A", help="significance level of both detectors (default 1e-8, the level "
                   "CacheProbe's code applies)")
    g.add_argument("--cached-fraction", type=float, metavar="F", help="cached_tokens detector: a probe counts as a hit when "
                   "the server reports at least this share of the shared prefix cached, rounded down to whole "
                   "blocks (default 0.9, CacheProbe's)")
    g.add_argument("--confidence", type=float, metavar="C", help="level of the bootstrap intervals (default 0.95)")
    g.add_argument("--block-size", type=int, metavar="N", help="the server's block size in tokens (default: "
                   "GET /server_info where the server says it, else the cached_tokens counts)")
    g = parser.add_argument_group("ablation (Gu et al.'s Figure 5)")
    g.add_argument("--sweep", choices=("prefix-fraction", "prompt-length"),
                   help="run the procedure at several prefix fractions or prompt lengths (one level) and plot "
                   "AP against the shared blocks: it falls to chance (0.5) as the shared prefix shrinks")
    g.add_argument("--sweep-values", metavar="LIST", help="the values (default prefix-fraction: "
                   "0.95,0.5,0.25,0.1,0.05,0; prompt-length: 500,250,100,50,25,10); with --sweep and no "
                   "--probes, 20 + 20 probes a value (six values: about 9 minutes on a CPU server)")
    g = parser.add_argument_group("politeness, recording, output")
    g.add_argument("--concurrency", type=int, metavar="N", help="procedures in flight at once (default 1: one request at a "
                   "time; more skews the timing)")
    g.add_argument("--max-requests", type=int, metavar="N", help="refuse a plan that sends more requests than "
                   "this (default 5000)")
    g.add_argument("--force", action="store_true", help="run even when the server's tokenizer merges letters "
                   "(the shared prefix in tokens is then not exact)")
    g.add_argument("--resume", metavar="ID", help="continue an interrupted run (session id or a unique prefix), "
                   "with the same keys; only the pace, budget and statistics flags may change. A finished run resumed "
                   "without keys sends nothing and prints its report again")
    add_db_arg(g)
    g.add_argument("--json", action="store_true", help="print the report as JSON (no progress lines)")
    g.add_argument("--plot", metavar="OUT.png", help="save the hit vs miss latency CDFs (and, with --sweep, "
                   "AP against the shared blocks)")


PROCEDURE = ("prompt_length", "prefix_fraction", "victim_sends", "probes", "seed", "model", "endpoint", "sweep",
             "control")


def _keys(args, read_key_file) -> list[str]:
    keys = list(args.key)
    if args.key_file:
        keys += read_key_file(args.key_file)
    if not keys and os.environ.get("OPENAI_API_KEY"):
        keys = [os.environ["OPENAI_API_KEY"]]  # as OpenAI clients do
    return keys


def _overrides(args) -> dict:
    """The flags given on the command line (not their defaults), as AuditParams fields."""
    out = {}
    for k in ("delay", "concurrency", "max_requests", "alpha", "confidence", "cached_fraction", "block_size"):
        if getattr(args, k) is not None:
            out[k] = getattr(args, k)
    if args.force:
        out["force"] = True
    return out


def main(args: argparse.Namespace) -> int:
    check_output_file(args.plot, "--plot", ".png")
    # Lazy, the command boundary: the audit's statistics import scipy (0.9 s niced on the 2-core
    # machine); `kvplay audit --help` and a bad flag answer without it.
    from kvplay.labs import audit
    from kvplay.labs.audit_report import plot

    keys = _keys(args, audit.read_key_file)
    say = (lambda s: None) if args.json else (lambda s: print(f"kvplay audit: {s}", file=sys.stderr, flush=True))
    progress = Progress("audit", enabled=not args.json, prefix="kvplay audit")
    if args.resume:
        given = [k for k in PROCEDURE if getattr(args, k) is not None] + (["level"] if args.level else []) + (
            ["paper"] if args.paper else []) + (["sweep-values"] if args.sweep_values else [])
        if given:
            raise KvplayError(f"--resume continues the recorded procedure: drop --{given[0].replace('_', '-')} "
                              "(only the pace, the budget and the statistics can change)")
        p = audit.AuditParams(url=args.url or "")
        result = audit.execute(p if args.url else None, keys, args.db, args.resume, _overrides(args), progress, say)
    else:
        if not args.url:
            raise KvplayError("give the server's URL (kvplay audit http://HOST:PORT), or --resume ID")
        p = audit.AuditParams(url=args.url)
        if args.paper:
            for k, v in audit.PAPER.items():
                setattr(p, k, v)
        if args.sweep and args.probes is None and not args.paper:
            p.probes = audit.SWEEP_PROBES
        for k in PROCEDURE:
            if getattr(args, k) is not None:
                setattr(p, k, getattr(args, k))
        for k, v in _overrides(args).items():
            setattr(p, k, v)
        if args.level:
            p.levels = [x.strip() for x in args.level.split(",") if x.strip()]
        elif len(keys) > 1:
            raise KvplayError(f"{len(keys)} keys given: say which levels they audit (--level org, --level global, "
                              "--level user,org …)")
        if args.sweep_values:
            p.sweep_values = _floats(args.sweep_values, "--sweep-values")
        result = audit.execute(p, keys, args.db, None, None, progress, say)
    emit(result, args.json, args.plot, plot)
    return 0
