"""The text of a recorded session's tokens, without loading its model: its tokenizer alone."""
from __future__ import annotations


def session_detokenizer(model: str | None):
    """`detokenize` for a recorded session's model when its tokenizer is on this machine, else None."""
    if not model:
        return None
    try:
        # Lazy: the loader imports transformers and torch (1.5 s niced on the 2-core machine, then
        # the tokenizer's load), paid when a session's text is wanted: not by `kvplay scrub` until
        # its tree screen opens (on a worker), nor by `kvplay tree --ids`.
        from kvplay.engine.model import load_tokenizer

        tok = load_tokenizer(model)
    except Exception:  # not here, not a tokenizer: ids instead
        return None
    return lambda ids: tok.decode(list(ids))
