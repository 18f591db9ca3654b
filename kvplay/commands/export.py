"""`kvplay export ID --format jsonl|md|toml|vllm-jsonl|vllm-msgpack|mooncake [-o FILE] [--db PATH]`.

jsonl: the session, then one object per turn, then one per event; md: a readable transcript;
toml: a `kvplay run` script that reproduces the session. The trace formats (sessions/traces.py):
vllm-jsonl / vllm-msgpack: the cache events as vLLM KV-event batches (one JSON object per line,
or the msgpack payloads back to back); mooncake: one request per line {timestamp,
input_length, output_length, hash_ids}. `kvplay import` and `kvplay simulate` read all three.

jsonl and the trace formats keep every byte (JSON escapes what it quotes). md is a transcript for
people, to a terminal or into a file alike: what the session recorded is shown inert
(kvplay/inert.py: a control or bidi character is shown, never obeyed; bodies keep their lines);
the bytes are jsonl's. toml escapes such characters (sessions/script.py), so the script replays
byte for byte.
"""
from __future__ import annotations

import argparse
import sys

from kvplay.inert import inert, json_dumps
from kvplay.options import KvplayError, add_db_arg, check_output_file
from kvplay.sessions.history import session_batches
from kvplay.sessions.query import load_session, resolve_session, session_script
from kvplay.sessions.report import attribution, computed_cell, when
from kvplay.sessions.script import dump_script
from kvplay.sessions.store import open_db
from kvplay.sessions.traces import TRACE_FORMATS, to_mooncake, to_vllm_jsonl, to_vllm_msgpack


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="session id (or a unique prefix)")
    parser.add_argument("--format", choices=("jsonl", "md", "toml") + TRACE_FORMATS, default="jsonl")
    parser.add_argument("-o", "--output", default=None, help="write to FILE instead of stdout")
    add_db_arg(parser)


def to_jsonl(s: dict) -> str:
    head = {k: v for k, v in s.items() if k not in ("turns", "events")}
    lines = [json_dumps({"type": "session", **head})]
    lines += [json_dumps({"type": "turn", **t}) for t in s["turns"]]
    lines += [json_dumps({"type": "event", **e}) for e in s.get("events", [])]
    return "\n".join(lines) + "\n"


def _body(text: str | None) -> str:
    """A prompt or a reply in the transcript: its lines kept, whole, inert."""
    return inert(text or "", lines=True, limit=None)


def to_md(s: dict) -> str:
    out = [f"# kvplay session {inert(s['id'])}", "",
           f"- source: {inert(s['source'])}; model: {inert(s['model'])}; recorded {when(s['created'])}",
           "- engine: " + ", ".join(f"`{k}={inert(v)}`" for k, v in s["engine_config"].items() if v is not None)]
    if s.get("replay_of"):
        out.append(f"- replay of {inert(s['replay_of'])}")
    out += ["", "## System prompt", "", _body(s.get("system_prompt")), "", "## Turns", ""]
    for t in s["turns"]:
        out.append(f"### {t['seq']}. {inert(t['user'])}")
        out += ["", "> " + _body(t["text"]).replace("\n", "\n> "), ""]
        out.append(_body(t["reply"]) if not t.get("error") else f"**error:** {inert(t['error'])}")
        att = attribution(t["cached_from"], t["user"])
        out += ["", f"*prompt {t['prompt_tokens']} tokens, cached {t['cached_tokens']}"
                + (f" ({att})" if att else "") + f", computed {computed_cell(t['computed_tokens'], t.get('miss'), t['user'])}, "
                f"TTFT {t['ttft_ms'] or 0:.1f} ms, {t['output_tokens']} tokens out*", ""]
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    check_output_file(args.output, "-o")
    if args.format == "vllm-msgpack" and not args.output and sys.stdout.isatty():
        raise KvplayError("--format vllm-msgpack is binary: give -o FILE (or redirect stdout)")
    db = open_db(args.db, create=False)
    try:
        if args.format in TRACE_FORMATS:
            text = trace_export(db, args.id, args.format)
        elif args.format == "toml":
            session = resolve_session(db, args.id)
            text = f"# kvplay session {session['id']} ({inert(session['source'])}, {inert(session['model'])})\n" + \
                dump_script(session_script(db, session))
        else:
            s = load_session(db, args.id, events=args.format == "jsonl")
            text = to_jsonl(s) if args.format == "jsonl" else to_md(s)
    finally:
        db.close()
    if args.output:
        try:
            with open(args.output, "wb" if isinstance(text, bytes) else "w", **({} if isinstance(text, bytes) else {"encoding": "utf-8"})) as f:
                f.write(text)
        except OSError as exc:
            raise KvplayError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    elif isinstance(text, bytes):
        sys.stdout.buffer.write(text)
    else:
        sys.stdout.write(text)
    return 0


def trace_export(db, ident: str, fmt: str):
    if fmt == "mooncake":
        return to_mooncake(db, ident)
    batches = session_batches(db, resolve_session(db, ident)["id"])
    return to_vllm_jsonl(batches) if fmt == "vllm-jsonl" else to_vllm_msgpack(batches)
