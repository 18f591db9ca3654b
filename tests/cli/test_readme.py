"""The README is a guide a newcomer follows: every `kvplay` command and flag it names exists (in
the real argparse parsers, kvplay/cli.py `build_parser`), every repository path, script and module
it names exists, it stays short (200 lines, 15 KB), and no tracked file holds an absolute machine
path. `readme_problems` returns what is wrong with a README text; the self-check below feeds it a
broken one, so the test is known to fail when the README drifts."""
from __future__ import annotations

import argparse
import glob
import re
import subprocess

import pytest

from kvplay.cli import COMMANDS, build_parser
from support import ROOT

MAX_LINES = 200
MAX_BYTES = 15 * 1024
# the folders and files at the top of the checkout a README may name
TOP = ("engine", "wire", "sessions", "serve", "tui", "labs", "bench", "kvplay", "tests", "examples",
       "screenshots", "docs", "scripts", ".ci")
PATH = re.compile(r"(?<![\w./~$-])(?:\./)?((?:%s)/[\w./*-]*[\w*]|dev|pyproject\.toml)(?![\w/-])" % "|".join(
    re.escape(t) for t in TOP))
MODULE = re.compile(r"(?<![\w.])kvplay((?:\.\w+)+)")
# a command line: `kvplay` first in its span, or after a folder (.venv/bin/kvplay) or a prompt ($ kvplay);
# elsewhere it is a word (`--peers kvplay`)
KVPLAY_CMD = re.compile(r"(?:^\s*|(?<=/)|(?<=\$ ))kvplay(?:\s+([a-z][\w-]*|-\S*))?(?![\w.:-])")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SCRIPT_CMD = re.compile(r"(?<![\w./-])(?:\./)?(scripts/[\w.-]+\.(?:py|sh))\b")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# where one command's words end inside a line of code
END = re.compile(r"\s(?:\||#|;|&&|<-)\s|`|$")
# an absolute path on a machine, assembled so this file does not hold one itself
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:%s)/" % "|".join(("work", "root", "tmp")))


def code_spans(text: str) -> list[str]:
    """Every line of a fenced block and every inline code span (one may wrap a line), with a
    table's `\\|` unescaped."""
    out, prose, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append(line)
        else:
            prose.append(line)
    spans = re.findall(r"`([^`]+)`", "\n".join(prose))
    return out + [" ".join(s.replace("\\|", "|").split()) for s in spans]


def options(parser: argparse.ArgumentParser) -> set[str]:
    """A parser's option strings, its subcommands' included (`lab leak --quick`)."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options(sub)
    return found


def command_options() -> dict[str, set[str]]:
    """Each command's options, from the real parsers (each command's module imported once)."""
    out = {}
    for name in COMMANDS:
        parser = build_parser(name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        out[name] = options(sub.choices[name])
    out[""] = set(build_parser(None)._option_string_actions)
    return out


def module_file(dotted: str):
    """kvplay.<package>.<module> (dotted without "kvplay.") as the file pyproject's package-dir
    maps it to: a folder at the top of the checkout, or kvplay/ itself."""
    parts = dotted.split(".")
    folder = parts[0] in TOP and (ROOT / parts[0] / "__init__.py").exists() and parts[0] != "kvplay"
    path = ROOT.joinpath(*parts) if folder else ROOT.joinpath("kvplay", *parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def readme_problems(text: str, opts: dict[str, set[str]]) -> list[str]:
    problems = []
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        problems.append(f"{len(lines)} lines (at most {MAX_LINES})")
    if len(text.encode()) > MAX_BYTES:
        problems.append(f"{len(text.encode())} bytes (at most {MAX_BYTES})")
    every_flag = set().union(*opts.values())
    for span in code_spans(text):
        for m in KVPLAY_CMD.finditer(span):
            word = m.group(1) or ""
            if word and not word.startswith("-") and word not in COMMANDS:
                problems.append(f"`kvplay {word}`: no such command ({span!r})")
                continue
            cmd = "app" if not word or word.startswith("-") else word  # `kvplay [flags]` is the app
            rest = span[m.end():]
            rest = rest[:END.search(rest).start()]
            for flag in FLAG.findall(rest):
                if flag not in opts[cmd] | opts[""]:
                    problems.append(f"`kvplay {cmd} {flag}`: no such option ({span!r})")
        for m in SCRIPT_CMD.finditer(span):
            script = ROOT / m.group(1)
            if not script.exists():
                continue  # the path check below says so
            rest = span[m.end():]
            rest = rest[:END.search(rest).start()]
            source = script.read_text()
            for flag in FLAG.findall(rest):
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    problems.append(f"{m.group(1)} {flag}: the script defines no such option")
        for m in MODULE.finditer(span):
            if m.group(1).startswith(".") and re.fullmatch(r"(\.\w+)+", m.group(1)):
                path = module_file(m.group(1)[1:])
                if not path.exists():
                    problems.append(f"kvplay{m.group(1)}: no such module ({path.relative_to(ROOT)})")
                    continue
                after = span[m.end():]
                after = after[:END.search(after).start()]
                for flag in FLAG.findall(after):
                    if f'"{flag}"' not in path.read_text():
                        problems.append(f"kvplay{m.group(1)} {flag}: the module defines no such option")
        if span.startswith("--"):  # a flag on its own: some command has it
            for flag in FLAG.findall(span.split()[0]):
                if flag not in every_flag:
                    problems.append(f"`{flag}`: no command has this option")
    outside = {m for span in code_spans(text) for m in re.findall(r"(?<![\w.])\.\./\S+", span)}
    outside |= {t for t in LINK.findall(text) if t.startswith("../")}
    problems += [f"{name}: outside the repository" for name in sorted(outside)]
    named = {m.group(1) for span in code_spans(text) for m in PATH.finditer(span)}
    named |= {t.split("#")[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)}
    for name in sorted(named):
        if not (glob.glob(str(ROOT / name)) if "*" in name else (ROOT / name).exists()):
            problems.append(f"{name}: no such file in the repository")
    return problems


@pytest.fixture(scope="module")
def opts():
    return command_options()


def test_the_readme_names_only_what_exists(opts):
    problems = readme_problems((ROOT / "README.md").read_text(), opts)
    assert not problems, "README.md:\n" + "\n".join(problems)


def test_the_check_fails_on_a_readme_that_drifted(opts):
    broken = "\n".join([
        "# x", "```", "kvplay frobnicate", ".venv/bin/kvplay run examples/shared-system.toml --no-such-flag",
        "scripts/serve_compare.py --repeat 3 --no-such-option", "python -m kvplay.bench.no_such_bench",
        "```", "`kvplay lab leak --quick` `--isolation user` `--not-a-flag` `examples/missing.toml`",
        "[gone](docs/no-such-page.md) `scripts/no-such-script.sh` `../shared/NOTES.md`", *["filler"] * MAX_LINES])
    problems = "\n".join(readme_problems(broken, opts))
    for expected in ("kvplay frobnicate", "run --no-such-flag", "serve_compare.py --no-such-option",
                     "kvplay.bench.no_such_bench", "--not-a-flag", "examples/missing.toml",
                     "docs/no-such-page.md", "scripts/no-such-script.sh", "lines (at most",
                     "../shared/NOTES.md: outside"):
        assert expected in problems, (expected, problems)
    for fine in ("lab --quick", "--isolation`", "shared-system.toml:"):
        assert fine not in problems, (fine, problems)


def tracked_text_files():
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for name in names.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (images, msgpack fixtures): not text anyone reads
            continue
        yield name, data.decode("utf-8", "replace")


def test_no_tracked_file_holds_an_absolute_machine_path():
    found = [f"{name}:{n}: {line.strip()[:120]}" for name, text in tracked_text_files()
             for n, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not found, "absolute machine paths (use env vars or the repo's layout):\n" + "\n".join(found)


def test_the_machine_path_check_can_fail():
    work, root, tmp = ("/" + d + "/" for d in ("work", "root", "tmp"))
    for bad in (f'VENV = "{work}vllm-venv"', f"see {root}.cache/x", f"ipc://{tmp}x", f"'{tmp}a'"):
        assert MACHINE_PATH.search(bad), bad
    for fine in ("$TMPDIR/kvplay-vllm-8000/", "~/.cache/kvplay/", "owner/root/file", "tests/work/x"):
        assert not MACHINE_PATH.search(fine), fine
