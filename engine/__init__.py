"""The engine: one model, one paged block pool, one thread (see engine.py)."""
from kvplay import only_as

only_as(__name__, "engine")
