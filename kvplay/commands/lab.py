"""`kvplay lab NAME`: run one lab on a real engine and print its table and verdict."""
from __future__ import annotations

import argparse
import importlib
import sys

from kvplay.labs.common import LabContext, Progress, emit, open_recorder
from kvplay.options import KvplayError, add_db_arg, add_engine_args, check_output_file, config_from_args
from kvplay.sessions.recorder import close_run

LABS = {
    "determinism": "kvplay.labs.determinism",
    "leak": "kvplay.labs.leak",
    "collide": "kvplay.labs.collide",
    "response-cache": "kvplay.labs.response_cache",
}


def _error(msg: str):
    return KvplayError(msg)


def _ints(text: str, flag: str, low: int = 1) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _error(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not out or any(v < low for v in out):
        raise _error(f"{flag}: every value must be an integer >= {low} (got {text!r})")
    return out


def _words(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if bad:
        raise _error(f"{flag}: unknown value {bad[0]!r} ({', '.join(allowed)})")
    return out


def _common(parser: argparse.ArgumentParser) -> None:
    """The options every lab takes."""
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", help="save a plot of the measurements")
    add_db_arg(parser)
    parser.add_argument("--no-record", action="store_true", help="do not record the run as a session")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    parser.add_argument("--max-tokens", type=int, help="tokens to generate per answer")


def _determinism(g) -> None:
    g.add_argument("--prompt", action="append", help="a prompt to test (repeatable; replaces the built-in set)")
    g.add_argument("--batch-sizes", default="4", help="concurrent batch sizes to try (default 4)")
    g.add_argument("--modes", default="default,deterministic", help="engine modes (default both)")


def _leak(g) -> None:
    g.add_argument("--blocks", default="1,4,8", help="prefix blocks shared with the secret (default 1,4,8)")
    g.add_argument("--samples", type=int, help="hit and miss probes per setting (default 102: AUC ± 0.08)")
    g.add_argument("--repeats", type=int, help="independent seeds pooled per setting (default 3)")
    g.add_argument("--quick", action="store_true", help="15 + 15 probes, one seed: a fast look, AUC ± 0.2")
    g.add_argument("--control", action="store_true", help="add an A/A row per setting: probes unrelated to the "
                   "victim, same procedure (tells chance and drift from a channel)")
    g.add_argument("--isolations", help="isolation modes to attack (default shared,user)")
    g.add_argument("--mitigations", default="delay,pad", help="delay,pad or none (default delay,pad)")
    g.add_argument("--delay-ms", type=float, help="random delay 0..X ms (default 3x the measured gap)")
    g.add_argument("--pad-ms", type=float, help="pad TTFT to X ms (default 2x the median miss)")


def _target(g) -> None:
    g.add_argument("--target", metavar="URL", help="run against this OpenAI-compatible server (vLLM, SGLang, "
                   "kvplay serve) instead of a local engine")
    g.add_argument("--api-key", metavar="K", help="the attacker's / measured user's API key (default $OPENAI_API_KEY)")
    g.add_argument("--other-api-key", metavar="K", help="the victim's / cache-warming user's API key "
                   "(default: the same key; the body's `user` tells keyless servers apart)")
    g.add_argument("--cache-salt-per-user", action="store_true", help="leak: also run with each client sending "
                   "its own random cache_salt (vLLM's request field)")
    g.add_argument("--target-model", metavar="NAME", help="model name on the target (default: the one it serves)")


def _collide(g) -> None:
    g.add_argument("--bits", type=int, help="hash width N for trunc:N (default 16, or N from --hash trunc:N)")
    g.add_argument("--feed", type=int, default=400, help="random prompts sent through the engine (default 400)")
    g.add_argument("--offline", type=int, default=20000, help="random blocks hashed offline (default 20000)")
    g.add_argument("--max-tries", type=int, default=2_000_000, help="budget of the crafted-pair search")


def _response_cache(g) -> None:
    g.add_argument("--question", default="Am I pretty?", help="what every user asks")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    g.add_argument("--seeds", default="1,2,3", help="one seed per user (default 1,2,3)")


# name -> (what it measures, its own option groups); `kvplay lab NAME --help` lists only NAME's.
LAB_OPTIONS = {
    "determinism": ("cached vs cold vs batched logits, default and deterministic mode",
                    [("determinism", _determinism), ("against a real server (labs/target.py)", _target)]),
    "leak": ("can another user tell a cache hit from their TTFT? (ROC AUC)",
             [("leak", _leak), ("against a real server (labs/target.py)", _target)]),
    "collide": ("hash collisions with a truncated hash, verify-on-hit off and on", [("collide", _collide)]),
    "response-cache": ("a response cache vs the KV prefix cache: 'Am I pretty?'",
                       [("response-cache", _response_cache)]),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lab", metavar="NAME", title="labs")
    for name, (help_, groups) in LAB_OPTIONS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        _common(p)
        for title, add in groups:
            add(p.add_argument_group(title))
        add_engine_args(p)


def build_params(args: argparse.Namespace):
    """(module, params, engine config overrides) for args.lab; raises KvplayError on bad input."""
    name = args.lab
    if name not in LABS:
        raise _error(f"name a lab: kvplay lab {{{','.join(LABS)}}} (each has --help)")

    def lab():  # the lab's module (and the engine: seconds) only once its options are checked
        return importlib.import_module(LABS[name])

    base: dict = {}
    if args.max_tokens is not None and args.max_tokens < 1:
        raise _error("--max-tokens must be at least 1")
    mt = {"max_tokens": args.max_tokens} if args.max_tokens else {}
    if name == "determinism":
        batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
        modes = _words(args.modes, "--modes", ("default", "deterministic"))
        if args.prompt and any(not p.strip() for p in args.prompt):
            raise _error("--prompt: empty prompt")
        params = lab().DeterminismParams(batch_sizes=batch_sizes, modes=modes, **mt)
        if args.prompt:
            params.prompts = list(args.prompt)
    elif name == "leak":
        counts = {}  # explicit --samples / --repeats win over --quick's
        for flag, v in (("samples", args.samples), ("repeats", args.repeats)):
            if v is not None and not 1 <= v <= 10_000:
                raise _error(f"--{flag} must be from 1 to 10000 (got {v})")
            if v is not None:
                counts[flag] = v
        isolations = (_words(args.isolations, "--isolations", ("shared", "user", "group", "system"))
                      if args.isolations else [args.isolation] if args.isolation else ["shared", "user"])
        mitigations = [m for m in _words(args.mitigations, "--mitigations", ("none", "delay", "pad")) if m != "none"]
        blocks = _ints(args.blocks, "--blocks")
        mod = lab()
        params = mod.LeakParams(blocks=blocks, isolations=isolations, mitigations=mitigations,
                                delay_ms=args.delay_ms, pad_ms=args.pad_ms, control=args.control, seed=args.seed,
                                **{**({"samples": mod.QUICK_SAMPLES, "repeats": 1} if args.quick else {}), **counts})
    elif name == "collide":
        bits = args.bits
        if bits is None and args.hash and args.hash.startswith("trunc:"):
            try:
                bits = int(args.hash.split(":", 1)[1])
            except ValueError:
                raise _error(f"--hash {args.hash!r}: N must be an integer from 1 to 256") from None
        bits = 16 if bits is None else bits
        if not 1 <= bits <= 256:
            raise _error(f"N bits must be from 1 to 256 (got {bits})")
        if args.feed < 1:
            raise _error(f"--feed must be at least 1 probe (got {args.feed})")
        if args.offline < 2 or args.max_tries < 1:
            raise _error("--offline must be at least 2 and --max-tries at least 1")
        params = lab().CollideParams(bits=bits, feed=args.feed, offline=args.offline, max_tries=args.max_tries,
                                     seed=args.seed, **mt)
        base["hash"] = f"trunc:{bits}"
        if args.num_blocks is None and args.cache_mb is None:
            base["num_blocks"] = args.feed + 64  # keep every fed block resident (no eviction hides a collision)
    else:
        seeds = _ints(args.seeds, "--seeds", low=0)
        if not args.question.strip():
            raise _error("--question: empty question")
        if args.temperature <= 0:
            raise _error("--temperature must be > 0 (answers must come from the seeds)")
        users = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
        if len(seeds) > len(users):
            raise _error(f"--seeds: at most {len(users)} users")
        params = lab().ResponseCacheParams(question=args.question, users=users[:len(seeds)], seeds=seeds,
                                           temperature=args.temperature, **mt)
    return lab(), params, base


def main(args: argparse.Namespace) -> int:
    mod, params, base = build_params(args)  # bad input answers before the engine is imported
    if not getattr(args, "target", None) and any(getattr(args, k, None) for k in (
            "api_key", "other_api_key", "cache_salt_per_user", "target_model")):
        raise _error("--api-key, --other-api-key, --cache-salt-per-user and --target-model need --target URL")
    if getattr(args, "target", None) and args.lab == "leak" and (args.control or args.repeats):
        raise _error("--control and --repeats are for the local engine (not --target)")

    # Lazy, the command boundary: the engine (torch, transformers: 5 s niced on the 2-core
    # machine) once the lab's options are checked; `kvplay lab X --help` and bad values answer at once.
    from kvplay.engine.engine import Engine
    from kvplay.labs.target import main as target_main

    if getattr(args, "target", None):
        return target_main(args, params)
    if args.lab == "collide":
        args.hash = None  # the lab sets trunc:N itself
    cfg = config_from_args(args, base)
    check_output_file(args.plot, "--plot", ".png")
    eng = Engine(cfg).start()  # the model loader reports its own progress on stderr
    rec = None
    try:
        if not args.no_record:
            rec = open_recorder(args.db, cfg, eng.model_name, args.lab, eng)
        ctx = LabContext(Progress(args.lab), rec)
        result = mod.run(eng, params, ctx)
    finally:
        close_run(rec, eng)
    emit(result, args.json, args.plot, mod.plot)
    if rec is not None:
        print(f"kvplay: recorded as session {rec.session_id} in {rec.path}", file=sys.stderr)
    return 0
