"""`kvplay export ID --format jsonl|md|toml [-o FILE] [--db PATH]`.

jsonl: the session, then one object per turn, then one per event; md: a readable transcript;
toml: a `kvplay run` script that reproduces the session.
"""
from __future__ import annotations

import argparse
import json
import sys

from .cli_list import when
from .cli_show import load
from .query import resolve_session, session_script
from .report import attribution
from .script import dump_script
from .store import open_db


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="session id (or a unique prefix)")
    parser.add_argument("--format", choices=("jsonl", "md", "toml"), default="jsonl")
    parser.add_argument("-o", "--output", default=None, help="write to FILE instead of stdout")
    parser.add_argument("--db", default=None, help="sessions database (default: XDG data dir, env KVPLAY_DB)")


def to_jsonl(s: dict) -> str:
    head = {k: v for k, v in s.items() if k not in ("turns", "events")}
    lines = [json.dumps({"type": "session", **head}, ensure_ascii=False)]
    lines += [json.dumps({"type": "turn", **t}, ensure_ascii=False) for t in s["turns"]]
    lines += [json.dumps({"type": "event", **e}, ensure_ascii=False) for e in s.get("events", [])]
    return "\n".join(lines) + "\n"


def to_md(s: dict) -> str:
    out = [f"# kvplay session {s['id']}", "",
           f"- source: {s['source']}; model: {s['model']}; recorded {when(s['created'])}",
           "- engine: " + ", ".join(f"`{k}={v}`" for k, v in s["engine_config"].items() if v is not None)]
    if s.get("replay_of"):
        out.append(f"- replay of {s['replay_of']}")
    out += ["", "## System prompt", "", s.get("system_prompt") or "", "", "## Turns", ""]
    for t in s["turns"]:
        out.append(f"### {t['seq']}. {t['user']}")
        out += ["", "> " + t["text"].replace("\n", "\n> "), ""]
        out.append(t["reply"] if not t.get("error") else f"**error:** {t['error']}")
        att = attribution(t["cached_from"], t["user"])
        out += ["", f"*prompt {t['prompt_tokens']} tokens, cached {t['cached_tokens']}"
                + (f" ({att})" if att else "") + f", computed {t['computed_tokens']}, "
                f"TTFT {t['ttft_ms'] or 0:.1f} ms, {t['output_tokens']} tokens out*", ""]
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    db = open_db(args.db, create=False)
    try:
        if args.format == "toml":
            session = resolve_session(db, args.id)
            text = f"# kvplay session {session['id']} ({session['source']}, {session['model']})\n" + \
                dump_script(session_script(db, session))
        else:
            s = load(db, args.id, events=args.format == "jsonl")
            text = to_jsonl(s) if args.format == "jsonl" else to_md(s)
    finally:
        db.close()
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            from kvplay.cli import KvplayError

            raise KvplayError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
