"""Smoke test of `kvplay screenshot` on the tiny model: it plays a script and writes an SVG."""
from __future__ import annotations


from kvplay.cli import main

SCRIPT = """
[engine]
num_blocks = 48

[[users]]
name = "alice"
max_tokens = 4

[[users]]
name = "bob"
max_tokens = 4

[[turns]]
user = "alice"
text = "What is a KV cache?"

[[turns]]
user = "bob"
text = "What is a KV cache for?"
"""


def test_screenshot_plays_script_and_writes_svg(tmp_path, capsys):
    script = tmp_path / "s.toml"
    script.write_text(SCRIPT)
    out = tmp_path / "shot.svg"
    rc = main(["screenshot", str(out), "--script", str(script), "--model", "tiny:llama", "--size", "120x36"])
    assert rc == 0
    svg = out.read_text()
    assert svg.startswith("<svg")
    assert "alice" in svg and "bob" in svg
    assert "cached&#160;" in svg  # a badge line was drawn
    assert "saved" in capsys.readouterr().err


def test_screenshot_rejects_bad_size(tmp_path, capsys):
    assert main(["screenshot", str(tmp_path / "x.svg"), "--size", "big", "--model", "tiny:llama"]) == 2
    assert "--size" in capsys.readouterr().err
