"""The badge, bars and looks are plain functions: check their exact text."""
from kvplay.engine.request import RequestStats
from kvplay.tui.format import badge, request_bar, sparkline
from kvplay.tui.theme import assign_looks


def test_badge_reads_like_the_issue():
    looks = assign_looks(["alice", "bob"])
    st = RequestStats("r1", "bob", prompt_tokens=532, cached_tokens=512, cached_from={"bob": 16, "alice": 496},
                      ttft_ms=140.0, decode_tok_s=18.2)
    assert badge(st, looks).plain == "prompt 532 · cached 512 (alice 496, own 16) · TTFT 0.14 s · 18 tok/s"
    assert badge(st, looks, timings=False).plain == "prompt 532 · cached 512 (alice 496, own 16)"
    cold = RequestStats("r2", "alice", prompt_tokens=40)
    assert badge(cold, looks).plain == "prompt 40 · cached 0 · TTFT – · –"


def test_request_bar_splits_cached_by_creator():
    looks = assign_looks(["alice", "bob"])
    st = RequestStats("r1", "bob", prompt_tokens=100, cached_tokens=50, cached_from={"alice": 50})
    bar = request_bar(st, looks, width=10)
    assert bar.plain.startswith("B █████░░░░░")


def test_looks_are_distinct_and_stable():
    looks = assign_looks(["alice", "anna", "bob"])
    assert [l.glyph for l in looks.values()] == ["A", "N", "B"]
    assert len({l.colour for l in looks.values()}) == 3
    more = assign_looks(["alice", "anna", "bob", "carl"], taken=looks)
    assert more["alice"] == looks["alice"] and more["carl"].glyph == "C"


def test_sparkline():
    assert sparkline([1, 2, 3]) == "▁▄█"
    assert sparkline([]) == ""


def test_event_log_names_a_group_change(make_engine):
    from kvplay.tui.format import event_line

    seen = []
    with make_engine(num_blocks=16) as eng:
        eng.subscribe_batches(lambda b: seen.extend(b.events))
        eng.register_user("mallory", None)
        eng.set_group("mallory", "alice")
        eng.stats(timeout=5)  # the engine thread has taken the command
    lines = [event_line(ev, {}) for ev in seen if ev.kind == "UserGroupChanged"]
    assert len(lines) == 1 and "mallory: (none) → alice" in lines[0]
