"""The TOML script format: parsing, clear errors, dump round trip."""
import pytest

from support import EXAMPLES

from kvplay.sessions.script import ScriptError, dump_script, load_script, parse_script

GOOD = """
[engine]
isolation = "user"
num_blocks = 32

[system]
prompt = "Be brief."

[[users]]
name = "alice"
seed = 7
temperature = 0.5

[[users]]
name = "bob"

[[turns]]
user = "alice"
text = "hi"
max_tokens = 4

[[turns]]
user = "bob"
text = "hello"
at = 0.5
"""


def test_parse_fields():
    s = parse_script(GOOD)
    assert s.engine == {"isolation": "user", "num_blocks": 32}
    assert s.system == "Be brief."
    assert [u.name for u in s.users] == ["alice", "bob"]
    assert s.user("alice").seed == 7 and s.user("alice").temperature == 0.5
    assert s.user("bob").seed is not None  # derived from the name
    assert s.turns[0].max_tokens == 4 and s.turns[1].at == 0.5


def test_dump_round_trip():
    s = parse_script(GOOD)
    again = parse_script(dump_script(s))
    assert again.engine == s.engine and again.system == s.system
    assert again.users == s.users and again.turns == s.turns


def test_multiline_system_round_trip():
    s = parse_script(GOOD)
    s.system = 'line one\nline "two" \\ three\n'
    assert parse_script(dump_script(s)).system == s.system


@pytest.mark.parametrize("text, fragment", [
    ("[[turns]]\nuser = 'a'\ntext = \n", "line 3"),  # malformed TOML names the line
    (GOOD.replace('user = "bob"', 'user = "zed"'), "unknown user 'zed'"),
    (GOOD.replace('text = "hi"', 'text = "  "'), "empty message"),
    (GOOD.replace("max_tokens = 4", "max_token = 4"), "unknown field(s) max_token"),
    ("[system]\nprompt = 'x'\n", "no [[turns]]"),
    ('[[turns]]\nuser = "a"\n', "needs `user` and `text`"),
    (GOOD + '\n[[users]]\nname = "alice"\n', "duplicate user names"),
])
def test_errors(text, fragment):
    with pytest.raises(ScriptError) as exc:
        parse_script(text, "s.toml")
    assert fragment in str(exc.value)
    assert "\n" not in str(exc.value).strip()


def test_users_implied_by_turns():
    s = parse_script('[[turns]]\nuser = "x"\ntext = "hi"\n')
    assert [u.name for u in s.users] == ["x"]


def test_load_missing(tmp_path):
    with pytest.raises(ScriptError, match="script not found"):
        load_script(tmp_path / "nope.toml")


def test_examples_parse():

    files = sorted(EXAMPLES.glob("*.toml"))
    assert len(files) >= 5
    for f in files:
        assert load_script(f).turns


@pytest.mark.parametrize("body,msg", [
    ('[[users]]\nname = "a"\ntemperature = "hot"\n', "temperature"),
    ('[[turns]]\nuser = "a"\ntext = "hi"\nseed = "x"\n', "seed"),
    ('[[turns]]\nuser = "a"\ntext = "hi"\nat = "soon"\n', "at"),
    ('[[turns]]\nuser = "a"\ntext = "hi"\nmax_tokens = -3\n', "negative"),
    ('turns = [1]\n', "array of tables"),
])
def test_field_types_are_checked(body, msg):
    text = body if "turns" in body.split("\n")[0] or "[[turns]]" in body else body + '[[turns]]\nuser = "a"\ntext = "hi"\n'
    with pytest.raises(ScriptError, match=msg):
        parse_script(text)


@pytest.mark.parametrize("engine", ['prefill_budget = "big"', 'deterministic = "false"', "hash_seed = 5"])
def test_engine_table_types_are_checked(engine):
    from kvplay.engine.config import EngineConfig
    from kvplay.engine.errors import EngineError

    script = parse_script(f'[engine]\n{engine}\n[[turns]]\nuser = "a"\ntext = "hi"\n')
    with pytest.raises(EngineError, match="must be"):
        EngineConfig.from_dict(script.engine).validate()
