"""The Textual app."""
from kvplay import only_as

only_as(__name__, "tui")
