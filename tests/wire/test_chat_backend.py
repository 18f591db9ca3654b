"""wire/chat_backend.py: one ChatBackend ABC for the local engine and a remote server, and the
Controls that say what each lets a client change (the app asks them; no action is overridden)."""
from __future__ import annotations

import pytest

from kvplay.engine.errors import EngineError
from kvplay.tui.backend import LocalEngineBackend
from kvplay.wire.chat_backend import CONTROLS, ChatBackend, Controls
from kvplay.wire.remote import RemoteBackend, remote_controls


def test_both_backends_are_chat_backends_and_the_abc_cannot_stand_alone():
    assert issubclass(LocalEngineBackend, ChatBackend) and issubclass(RemoteBackend, ChatBackend)
    with pytest.raises(TypeError):
        ChatBackend()


def test_controls_say_what_is_supported_and_why_not():
    c = remote_controls("http://127.0.0.1:1")
    assert c.supports("clear") and not any(c.supports(n) for n in CONTROLS if n != "clear")
    assert "server's setting" in c.refusal("isolation") and "--target http://127.0.0.1:1" in c.refusal("labs")
    assert Controls().refusal("eviction") == "This backend does not support changing eviction."
    with pytest.raises(KeyError):
        c.supports("warp-drive")


def test_the_local_backend_changes_the_engine_through_its_queue(make_engine):
    eng = make_engine(isolation="shared")
    b = LocalEngineBackend(eng)
    assert all(b.controls.supports(n) for n in CONTROLS)
    b.reconfigure(isolation="user")
    assert b.setting("isolation") == "user" == eng.config.isolation
    assert isinstance(b.clear_cache(), int)


def test_an_unsupported_control_is_one_engine_error_line():
    class Minimal(ChatBackend):  # a backend that supports no control (the defaults)
        register_user = submit = decode = close = subscribe_batches = stats = summary = arrays = block = None
        num_blocks = version = 0

    b = Minimal()
    for call in (b.clear_cache, lambda: b.reconfigure(eviction="lfu"), lambda: b.set_group("a", "g")):
        with pytest.raises(EngineError):
            call()
