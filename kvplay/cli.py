"""`kvplay` command line: one parser; each subcommand is a module of kvplay/commands/ named for it.

Every user-facing failure is one line on stderr and exit code 2 (KvplayError/EngineError);
never a traceback. The line is inert (kvplay/inert.py): what it quotes is shown, never obeyed.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from kvplay.engine.errors import EngineError
from kvplay.inert import inert

# name -> (module, help). The module defines configure(parser) and main(args) -> int; it is
# imported only when its command runs.
COMMANDS = {
    "app": ("kvplay.commands.app", "open the multi-user chat playground (the default)"),
    "run": ("kvplay.commands.run", "play a TOML script headless and report per-turn cache use"),
    "sessions": ("kvplay.commands.sessions", "list recorded sessions"),
    "show": ("kvplay.commands.show", "show one recorded session"),
    "export": ("kvplay.commands.export", "export a session as jsonl, md, a toml script, vLLM KV events or a Mooncake trace"),
    "replay": ("kvplay.commands.replay", "replay a recorded session and compare outputs"),
    "simulate": ("kvplay.commands.simulate", "what other pool sizes, policies, isolation would have reused, vs the optimum"),
    "explain": ("kvplay.commands.explain", "why prompt tokens missed the cache, the cache breakers, and what each fix would give"),
    "scrub": ("kvplay.commands.scrub", "step, play and seek through a recorded session's cache, no model loaded"),
    "import": ("kvplay.commands.import_", "record a trace file (vLLM KV events, Mooncake JSONL) as a session"),
    "lab": ("kvplay.commands.lab", "measure a claim about shared KV caches"),
    "bench": ("kvplay.commands.bench", "kvplay vs Hugging Face generate and friends, as ratios"),
    "screenshot": ("kvplay.commands.screenshot", "play a script in the app headless and save an SVG"),
    "serve": ("kvplay.commands.serve", "serve the engine over OpenAI-compatible HTTP, with vLLM's KV events"),
    "watch": ("kvplay.commands.watch", "mirror a running vLLM/SGLang/kvplay server's prefix cache from its KV events"),
    "tree": ("kvplay.commands.tree", "the cached prefixes as a tree of text, who made and reused them (a session or a server)"),
    "attach": ("kvplay.commands.attach", "the playground on a running vLLM/SGLang/kvplay server: its API, its KV events"),
    "audit": ("kvplay.commands.audit", "audit an OpenAI-compatible endpoint for prompt-cache sharing between API keys (Gu et al.'s procedure)"),
}


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (the usage is one `--help` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; only `command`'s module is imported (None: none of them), so `kvplay
    --help` and a bad flag answer at once instead of after importing torch and transformers."""
    parser = Parser(prog="kvplay", description=(
        "See how a shared, paged LLM prefix KV cache behaves: many users, one model, one block pool."))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name != command:
            continue
        mod = importlib.import_module(module)
        mod.configure(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["app"] + argv
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return int(args._main(args) or 0)
    except EngineError as exc:
        print(f"kvplay: error: {inert(exc)}", file=sys.stderr)  # it may quote a user's or a server's text
        return 2
    except KeyboardInterrupt:
        print("kvplay: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
