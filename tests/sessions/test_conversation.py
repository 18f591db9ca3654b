"""sessions/conversation.py: the one conversation and turn-pacing piece the app's panes and
sessions/player.py share (what a prompt holds, which turns wait for which, how a stream is read),
and the player on a real tiny engine following it."""
from __future__ import annotations

from kvplay.engine.sampling import SamplingParams
from kvplay.sessions.conversation import Conversation, Pacing, consume
from kvplay.sessions.player import Job, play


def test_a_conversation_is_the_system_prompt_then_the_users_answered_turns():
    c = Conversation()
    assert c.messages("sys", "hi") == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    c.add("hi", "hello")
    assert c.messages("", "more") == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                      {"role": "user", "content": "more"}]


def test_pacing_untimed_turns_follow_the_previous_timed_ones_overlap_a_user_waits_for_their_own():
    p = Pacing([("a", None), ("b", None), ("a", 1.0), ("c", 1.0), ("c", None)], speed=2.0)
    assert p.after == [[], [0], [0], [], [3]]  # turn 2 (a, timed) waits only for a's turn 0
    assert [p.due(i) for i in range(len(p))] == [0.0, 0.0, 0.5, 0.5, 0.0]
    assert Pacing([("a", 3.0)], speed=0).due(0) == 0.0  # speed 0: timed turns all at once


def test_consume_reads_the_stream_then_the_result(make_engine):
    eng = make_engine()
    seen = []
    res = consume(eng.submit("alice", [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5)),
                  seen.append)
    assert res.error is None and seen and seen[-1] == res.text
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))  # text so far, growing


def test_the_player_builds_each_users_prompt_from_their_own_conversation(make_engine):
    eng = make_engine()
    sp = SamplingParams(max_tokens=3)
    done = play(eng, [Job(1, "a", "one", sp), Job(2, "b", "two", sp), Job(3, "a", "three", sp)], "sys")
    assert [d.ok for d in done] == [True, True, True]
    assert done[2].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "one"},
                                {"role": "assistant", "content": done[0].result.text},
                                {"role": "user", "content": "three"}]
    assert done[1].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "two"}]
