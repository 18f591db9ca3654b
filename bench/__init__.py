"""`kvplay bench`: measured ratios against peers."""
from kvplay import only_as

only_as(__name__, "bench")
