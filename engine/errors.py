"""The one exception type the engine raises for bad input or configuration.

Front ends print its message as a single line (CLI exit code 2); it never carries a traceback.
"""


class EngineError(Exception):
    """A user-facing error: bad input, bad option, missing model, request that cannot fit."""
