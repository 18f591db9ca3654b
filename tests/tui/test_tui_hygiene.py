"""The engine and sessions packages never pull in Textual (the app depends on them, not back)."""
import subprocess
import sys


def test_engine_and_sessions_do_not_import_textual():
    code = (
        "import sys, pkgutil, importlib\n"
        "import kvplay.engine, kvplay.sessions\n"
        "for pkg in (kvplay.engine, kvplay.sessions):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(pkg.__name__ + '.' + m.name)\n"
        "bad = sorted(m for m in sys.modules if m == 'textual' or m.startswith('textual.'))\n"
        "print(len(bad)); sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
