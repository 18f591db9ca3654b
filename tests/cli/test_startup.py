"""Start-up: `kvplay --help` imports the standard library and the parser alone; no command's
`--help` imports torch, transformers or matplotlib; and kvplay's modules import at their top,
except the few lazy imports listed here, each with its measured reason."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (file, function) -> why its import waits for the call. Costs measured niced on the project's
# 2-core machine (`python -c "import time; t = time.perf_counter(); import MODULE; ..."`).
LAZY_KVPLAY = {
    ("sessions/headless.py", "start_engine"):
        "run, replay and serve print the loading line and check --model before the engine's import (2.6 s)",
    ("tui/app.py", "KvplayApp.open_backend"):
        "the app is on screen before the engine's import (2.6 s); `kvplay attach` never pays it",
    ("sessions/tokenizer.py", "session_detokenizer"):
        "a session's tokenizer (transformers, torch) only when its text is shown",
    ("kvplay/commands/simulate.py", "_report"):
        "the command boundary: the simulator imports the engine's scheduler (torch, transformers)",
    ("kvplay/commands/explain.py", "main"):
        "the command boundary: the explanation runs the simulator (torch, transformers)",
    ("kvplay/commands/import_.py", "main"):
        "the command boundary: an import replays the trace through the simulator (torch, transformers)",
    ("kvplay/commands/audit.py", "main"):
        "the command boundary: the audit's statistics import scipy",
    ("kvplay/commands/lab.py", "main"):
        "the command boundary: the engine (torch, transformers) once the lab's options are checked",
    ("kvplay/commands/serve.py", "main"):
        "the command boundary: the server and its engine side import torch",
    ("kvplay/commands/bench.py", "main"):
        "the command boundary: the benchmarks import the engine, torch and transformers",
}
LAZY_OTHER = {
    ("kvplay/options.py", "pyplot"): "matplotlib, for --plot alone",
    ("bench/peers.py", "run_hf_cb"): "transformers' continuous batching may be missing: that peer is then reported unavailable",
}


def package_dirs() -> dict[str, Path]:
    """kvplay's packages and the folders they live in (pyproject.toml's package-dir)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setup["package-dir"]
    return {pkg: ROOT / dirs.get(pkg, dirs["kvplay"] + pkg[len("kvplay"):].replace(".", "/"))
            for pkg in setup["packages"]}


def function_imports(path: Path):
    """(qualified function name, imported module, own?) for every import inside a function."""
    out = []

    def walk(node, scope: list[str], in_function: bool):
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.ImportFrom):
                    mods = ["." * child.level + (child.module or "")]
                else:
                    mods = [a.name for a in child.names]
                for m in mods:
                    out.append((".".join(scope), m, m.startswith(".") or m.split(".")[0] == "kvplay"))
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(child, scope + [child.name], in_function or not isinstance(child, ast.ClassDef))
            else:
                walk(child, scope, in_function)

    walk(ast.parse(path.read_text(), str(path)), [], False)
    return out


def test_kvplay_modules_import_at_the_top():
    own, other = {}, {}
    files = sorted({f for d in package_dirs().values() for f in d.glob("*.py")})
    assert len(files) > 100, files  # the scan found the package
    for f in files:
        for func, module, is_own in function_imports(f):
            (own if is_own else other).setdefault((f.relative_to(ROOT).as_posix(), func), []).append(module)
    unlisted = {k: v for k, v in own.items() if k not in LAZY_KVPLAY}
    assert not unlisted, f"imports of kvplay inside functions: move them to the module's top {unlisted}"
    assert not set(LAZY_KVPLAY) - set(own), f"stale LAZY_KVPLAY entries: {set(LAZY_KVPLAY) - set(own)}"
    unlisted = {k: v for k, v in other.items() if k not in LAZY_OTHER}
    assert not unlisted, f"imports inside functions: move them to the module's top {unlisted}"
    assert not set(LAZY_OTHER) - set(other), f"stale LAZY_OTHER entries: {set(LAZY_OTHER) - set(other)}"


def run_python(code: str, *argv: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_kvplay_help_imports_the_standard_library_and_the_parser_alone():
    code = ("import contextlib, io, json, sys\nfrom kvplay.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
            "assert 'COMMAND' in out.getvalue(), out.getvalue()\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    loaded = json.loads(run_python(code))
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "textual", "matplotlib", "numpy")]
    assert not heavy, heavy
    ours = {m for m in loaded if m.split(".")[0] == "kvplay"}
    assert ours == {"kvplay", "kvplay.cli", "kvplay.inert", "kvplay.engine", "kvplay.engine.errors"}, ours
    third = sorted({m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names) - {"kvplay", "sitecustomize",
                                                                                        "usercustomize"})
    third = [m for m in third if not m.startswith("_")]  # CPython's private modules (_distutils_hack, …)
    assert not third, f"`kvplay --help` imports third-party packages: {third}"


def test_no_command_help_imports_torch_transformers_or_matplotlib():
    """Each command's parser (what `kvplay CMD --help` and a bad flag build) in one process, the
    first command that pulls one in named."""
    code = ("import json, sys\nfrom kvplay.cli import COMMANDS, build_parser\nfirst = {}\n"
            "for name in COMMANDS:\n"
            "    build_parser(name)\n"
            "    for m in ('torch', 'transformers', 'matplotlib'):\n"
            "        if m in sys.modules:\n            first.setdefault(m, name)\n"
            "print(json.dumps(first))\n")
    assert json.loads(run_python(code)) == {}


def test_watching_a_server_imports_no_torch():
    """`kvplay watch` and the remote backend of `tree URL` and `attach` mirror a server from its events:
    no model in this process."""
    code = ("import json, sys\n"
            "import kvplay.commands.watch, kvplay.sessions.watch, kvplay.sessions.recorder, kvplay.wire.remote\n"
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))\n")
    assert json.loads(run_python(code)) == []
