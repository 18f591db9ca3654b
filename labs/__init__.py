"""Labs: each claim (non-determinism, leaks, collisions, response caching) measured to a verdict."""
from kvplay import only_as

only_as(__name__, "labs")
