"""kvplay/inert.py, the rule every human view applies (issue #42), and the two writers built on it
that must stay exact: TOML scripts and JSON lines."""
from __future__ import annotations

import json
import tomllib

from hypothesis import given, settings
from hypothesis import strategies as st

from support.hostile import RAW

from kvplay.inert import hidden, inert, json_dumps, scalars
from kvplay.sessions.script import _toml_value


def test_what_is_shown_and_how():
    assert inert("a\x1b]52;c;x\x07b") == "a␛]52;c;x␇b"
    assert inert("nul\x00 del\x7f c1\x9b") == "nul␀ del␡ c1<U+009B>"
    assert inert("x\u202ey\u2066z\u2069") == "x<U+202E>y<U+2066>z<U+2069>"
    assert inert("a\nb\tc") == "a␊b␉c" and inert("a\nb\tc", lines=True) == "a\nb\tc"
    assert inert("a\r\nb", lines=True) == "a␍\nb"  # a CR can hide a line's start: always shown
    assert inert("[/b] [link=http://e.vl]x[/link]") == "[/b] [link=http://e.vl]x[/link]"  # markup: the views' half
    assert inert("lone \ud800") == "lone <U+D800>" and inert("\U000e0041") == "<U+E0041>"
    assert inert(None) == "None" and inert(42) == "42"


def test_joiners_hide_only_next_to_ascii():
    assert inert("ad\u200dmin") == "ad<U+200D>min" and inert("\u200cx") == "<U+200C>x"
    family = "👨\u200d👩\u200d👧"
    assert inert(family) == family  # an emoji sequence stays one picture
    assert inert("ab\u200b") == "ab<U+200B>"  # a zero-width space is never layout


def test_bounded():
    assert inert("x" * 10, limit=4) == "xxxx… (+6 characters)"
    assert len(inert("\x1b" * 100_000)) < 5000  # the default bound: a 64 KB line never wedges a view


def test_hidden_names_the_first_one():
    assert hidden("alice") is None and hidden("ali\x1bce") == "␛" and hidden("b\u202e") == "<U+202E>"
    assert hidden("a\nb") == "␊" and hidden("a\nb", lines=True) is None


def test_scalars_makes_a_servers_text_writable():
    assert scalars("a\ud800b") == "a\ufffdb" and scalars("é😀") == "é😀"
    scalars("a\udfffb").encode("utf-8")


TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40) | st.sampled_from(
    ["\x1b]0;t\x07", "\u202e", "a\u200db", '"""', "\\", "'", "\r\n", "\x7f\x9b", "\U000e0041"])


@settings(max_examples=400, deadline=None)
@given(TEXT)
def test_toml_strings_parse_back_byte_for_byte_and_show_inert(s):
    s = scalars(s)  # lone surrogates have no UTF-8: a recording never holds them
    written = f"v = {_toml_value(s)}"
    assert tomllib.loads(written)["v"] == s
    assert RAW.search(written.replace("\n", "")) is None


@settings(max_examples=400, deadline=None)
@given(st.lists(TEXT, max_size=4))
def test_json_lines_parse_back_exactly_and_show_inert(items):
    written = json_dumps({"t": items})
    assert json.loads(written) == {"t": items}
    assert RAW.search(written) is None
