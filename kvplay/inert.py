"""Text that came from a user, a server, a recording or a file is data: never markup, never control.

The one rule every human view applies: the Textual app (panes, block detail, legend, tree, event
log, lab screens, the scrubber), `show`, `run`, `replay`, `tree`, `watch`, `export --format md`,
start-up lines and error messages. Machine outputs (`--json`, `jsonl`, `vllm-*`) keep the bytes:
JSON escapes them (`json_dumps` escapes the hidden characters JSON itself would leave raw, so a
JSON line parses to the exact text and is inert on a terminal too).

**Control.** `inert(text)` shows every character a terminal or a reader would not see as itself:

- C0 controls and DEL as their Unicode control pictures: ESC `␛`, NUL `␀`, BEL `␇`, CR `␍`,
  and in a one-line field (a name, an id, a table cell) LF `␊` and TAB `␉` too. A chat body or a
  transcript (`lines=True`) keeps LF and TAB: the layout a view shows.
- As `<U+XXXX>`: C1 controls (U+0080–U+009F: CSI U+009B, NEL …), the bidi marks, embeddings,
  overrides and isolates (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069, U+206A–U+206F),
  zero-width space U+200B, word joiner and invisible operators U+2060–U+2064, the BOM U+FEFF,
  U+180E, interlinear annotations U+FFF9–U+FFFB, line and paragraph separators U+2028/U+2029,
  tag characters U+E0000–U+E007F (they spell hidden ASCII) and lone surrogates (a server's
  JSON `"\\ud800"`: they cannot even be written as UTF-8).
- Zero-width (non-)joiners U+200C/U+200D where they touch ASCII or an end of the text
  (`ad<U+200D>min`): between two other characters they write emoji sequences and Indic or
  Persian words, and stay.

**Size.** At most `limit` characters are shown, then `… (+N characters)`: a 64 KB line never
wedges a view (a table cell, a status line, a tree label).

**Markup.** Rich and Textual parse `[b]`, `[link=…]` and `:emoji:` codes in strings; a view builds
`rich.text.Text` (or Textual `Content`) from inert strings, which nothing parses, and never puts
such text in a markup string.

Names that identify people are checked where they enter (`hidden`: the API-keys file, a keyless
server's body `user`): refused with one line, so they are clean wherever they go next.

The bottom layer (pyproject's [tool.importlinter]): the standard library only, so every layer that
renders text, the engine included, can use it.
"""
from __future__ import annotations

import json
import re
from typing import Callable

LIMIT = 4096         # characters of one field a view shows (a name, a cell, a line)
BODY_LIMIT = 65536   # ... of a chat body, a transcript's turn, a tree node's text

_HIDDEN = ("\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u180e\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064"
           "\u2066-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff\U000e0000-\U000e007f")
_JOINERS = "\u200c\u200d"
_EDGE_JOINER = rf"(?<![^\x00-\x7f])[{_JOINERS}]|[{_JOINERS}](?![^\x00-\x7f])"
# what a view shows visibly: in a body (LF and TAB are layout), and in a one-line field
IN_BODY = re.compile(rf"[{_HIDDEN}]|{_EDGE_JOINER}")
IN_LINE = re.compile(rf"[\t\n{_HIDDEN}]|{_EDGE_JOINER}")
_SUSPECT = re.compile(rf"[\t\n{_HIDDEN}{_JOINERS}]")  # a plain character class: the quick first look


def visible(ch: str) -> str:
    """How one hidden character is shown: `␛` for C0 and DEL, `<U+202E>` for the rest."""
    o = ord(ch)
    if o < 0x20:
        return chr(0x2400 + o)
    if o == 0x7F:
        return "\u2421"
    return f"<U+{o:04X}>"


def inert(text, *, lines: bool = False, limit: int | None = LIMIT,
          show: Callable[[str], str] = visible) -> str:
    """`text` (any value: str() of it) with every hidden character shown (`show`), at most `limit`
    characters of it (None: all). `lines`: a body whose LF and TAB are layout."""
    s = text if isinstance(text, str) else str(text)
    tail = ""
    if limit is not None and len(s) > limit:
        tail = f"… (+{len(s) - limit:,} characters)"
        s = s[:limit]
    if _SUSPECT.search(s) is not None:
        s = (IN_BODY if lines else IN_LINE).sub(lambda m: show(m.group()), s)
    return s + tail


def hidden(text: str, *, lines: bool = False) -> str | None:
    """The first character `inert` would show differently, shown (`␛`, `<U+202E>`); None when
    the text is clean. Where a name enters: refuse it with one line naming this."""
    m = (IN_BODY if lines else IN_LINE).search(text)
    return None if m is None else visible(m.group())



_SURROGATE = re.compile("[\ud800-\udfff]")


def scalars(text: str) -> str:
    """`text` with lone surrogates (a server's JSON `"\\ud800"`) as U+FFFD, what a decoder makes of
    invalid UTF-8: text a recording and a terminal can take. Where a server's text enters."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def _json_escape(ch: str) -> str:
    o = ord(ch)
    if o > 0xFFFF:  # a tag character: JSON spells it as a surrogate pair
        o -= 0x10000
        return f"\\u{0xD800 + (o >> 10):04x}\\u{0xDC00 + (o & 0x3FF):04x}"
    return f"\\u{o:04x}"


def json_dumps(obj, **kw) -> str:
    """`json.dumps(obj)` with readable text (not ASCII-only) and every hidden character a `\\uXXXX`
    escape: it parses back to exactly `obj` (lone surrogates included) and shows inert."""
    return inert(json.dumps(obj, ensure_ascii=False, **kw), lines=True, limit=None, show=_json_escape)
