"""kvplay.

The folders at the top of a checkout (engine/, sessions/, tui/, labs/, bench/, wire/, serve/) are
the subpackages kvplay.engine, kvplay.sessions, ... (pyproject.toml's package-dir maps them; an
editable install makes `import kvplay.engine` load engine/). Each one refuses to be imported
under its bare folder name, so running from a checkout can never load a second, top-level copy.
"""


def only_as(name: str, folder: str) -> None:
    """Called first thing by each subpackage's __init__: `name` must be kvplay.<folder>."""
    if name != f"kvplay.{folder}":
        raise ImportError(f"{folder}/ is the package kvplay.{folder}: import kvplay.{folder}, not {name} "
                          f"(install kvplay, e.g. `pip install -e .`, so kvplay.{folder} maps to this folder)")
