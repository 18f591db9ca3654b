"""The text of a recorded session's tokens, without loading its model: its tokenizer alone."""
from __future__ import annotations


def session_detokenizer(model: str | None):
    """`detokenize` for a recorded session's model when its tokenizer is on this machine, else None."""
    if not model:
        return None
    try:  # start-up time: transformers is imported only when a label is wanted
        if model.startswith("tiny:"):
            from kvplay.engine.tiny import build_tokenizer

            tok = build_tokenizer()
        else:
            from kvplay.engine.model import DEFAULT_MODEL, EMBEDDED_NAME, ensure_converted

            from transformers import AutoTokenizer

            path = str(ensure_converted(lambda *_: None)) if model in (DEFAULT_MODEL, EMBEDDED_NAME) else model
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # not here, not a tokenizer: ids instead
        return None
    return lambda ids: tok.decode(list(ids))
