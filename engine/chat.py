"""Chat rendering: messages -> token ids with the model's chat template, and the length of
the system-prompt part (for the `system` isolation mode)."""
from __future__ import annotations

from .errors import EngineError


def _render(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_chat(tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """Return (prompt token ids, number of leading tokens that belong to the system prompt)."""
    if not messages:
        raise EngineError("empty conversation")
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant"):
            raise EngineError(f"unknown message role {m.get('role')!r}")
    last = messages[-1]
    if last["role"] == "user" and not str(last.get("content", "")).strip():
        raise EngineError("empty message")
    if getattr(tokenizer, "chat_template", None):
        ids = _render(tokenizer, messages, True)
        system = [m for m in messages[:1] if m["role"] == "system"]
        sys_len = 0
        if system:
            sys_ids = _render(tokenizer, system, False)
            n = 0
            while n < min(len(sys_ids), len(ids)) and sys_ids[n] == ids[n]:
                n += 1
            sys_len = n
        return ids, sys_len
    # No chat template: plain "role: content" lines (base models).
    lines, sys_len = [], 0
    for m in messages:
        lines.append(f"{m['role']}: {m['content']}\n")
    prefix = "".join(lines[:1]) if messages[0]["role"] == "system" else ""
    text = "".join(lines) + "assistant:"
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if prefix:
        sys_len = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    return ids, sys_len
