"""sessions/report.py: the one number formatting every text view uses (session, lab and bench
tables, the app's stats), pinned to what each view printed before they shared it."""
from kvplay.sessions.report import cached_cell, fmt, fmt_num, human_bytes, mib


def test_fmt_cells():
    assert fmt(None) == "—" and fmt(True) == "yes" and fmt(False) == "no"
    assert fmt({"alice": 32, "bob": 16}) == "alice 32, bob 16" and fmt(["a", "b"]) == "a, b" and fmt([]) == "—"
    assert [fmt(x) for x in (0.0, 3.14159, 15.55, 12345.6, 0.0001, 7)] == ["0", "3.14", "15.6", "1.23e+04",
                                                                         "1.00e-04", "7"]


def test_fmt_with_a_spec():
    assert fmt(1.234, ".1f", none="–") == "1.2" and fmt(None, ".1f", none="–") == "–"
    assert fmt(0.456, ".0%") == "46%" and fmt(5, "d") == "5" and fmt(True, ".1f") == "yes"


def test_session_numbers_and_bytes():
    assert fmt_num(None) == "-" and fmt_num(3) == "3" and fmt_num(2.345) == "2.3" and fmt_num(2.345, 2) == "2.35"
    assert mib(12.5 * 2**20) == "12.5 MiB" and mib(2**20, unit=False) == "1.0" and mib(None) == "–"
    assert human_bytes(None) == "-" and human_bytes(512) == "512 B" and human_bytes(3 * 2**30) == "3.0 GiB"


def test_cached_cell():
    assert cached_cell(512, None, {"alice": 496, "bob": 16}, "bob") == "512 (alice 496, own 16)"
    assert cached_cell(32, 34, {"alice": 32}, "bob") == "32/34 (alice 32)"
    assert cached_cell(0, None, {}, "bob") == "0" and cached_cell(None, None, None, "bob") == "-"
    assert cached_cell(192, None, {}, "bob") == "192"  # a trace's turn: cached, by no one known
