"""The repository's scripts/ as modules, for tests of their functions (scripts/ is no package)."""
from __future__ import annotations

import importlib.util
import sys

from support import SCRIPTS


def load_script(name: str):
    """scripts/NAME.py imported once, as the module `kvplay_script_NAME`."""
    mod_name = f"kvplay_script_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    return sys.modules[mod_name]
