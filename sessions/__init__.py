"""Sessions: scripts, the SQLite store, recording, replay and reports (no Textual)."""
from kvplay import only_as

only_as(__name__, "sessions")
