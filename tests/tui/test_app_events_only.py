"""The app reads nothing from the engine but its events (issue #19).

`EventsOnly` puts a real Engine behind the few things a client may do with one: bind a user
(identity stays in the engine's registry), submit a turn, subscribe to its event stream and
its per-step batches, know the pool's size and the settings it was built with, detokenise, stop,
and send it setting changes. No pool, no stats, no observer, no lock: any other attribute is an
AttributeError, so a view that reached into the engine would fail this test. The block map, the
stats panel, the badges and the hit marks must still come out right."""
from __future__ import annotations

from support.tui import badges, make_app, say, wait_until

from kvplay.engine.engine import Engine
from kvplay.tui.backend import LocalEngineBackend
from kvplay.tui.blockmap import BlockMap

ALLOWED = ("register_user", "submit", "subscribe_batches", "num_blocks", "block_bytes",
           "config", "model_name", "tokenizer", "shutdown", "reconfigure", "needs_fresh_cache",
           "clear_cache", "set_group")


class EventsOnly:
    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name: str):
        if name in ALLOWED:
            return getattr(object.__getattribute__(self, "_engine"), name)
        raise AttributeError(f"the app reached into the engine: {name}")


def events_only_app(loaded):
    app = make_app(loaded)

    def open_backend():
        eng = Engine(app.config, loaded=loaded)
        facade = EventsOnly(eng)
        app.cache.listen(facade)
        backend = LocalEngineBackend(facade)
        eng.start()
        return backend

    app.open_backend = open_backend
    return app


async def test_the_app_works_on_an_engine_that_exposes_only_submit_and_its_events(tiny_llama):
    app = events_only_app(tiny_llama)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_until(pilot, lambda: app.backend is not None)
        assert isinstance(app.backend.engine, EventsOnly)
        await say(app, pilot, "alice", "What is a KV cache in a transformer?")
        await say(app, pilot, "bob", "What is a KV cache in a transformer, and why?")
        stats = app.cache.requests[-1]
        assert stats.user == "bob" and stats.cached_from.get("alice", 0) >= 16
        assert f"cached {stats.cached_tokens} (alice {stats.cached_from['alice']})" in badges(app, "bob")[-1]
        bm = app.query_one(BlockMap)
        assert bm.hit and all(app.backend.block(i).creator == "alice" for i in bm.hit)
        panel = app.backend.stats()
        assert panel["blocks_cached"] + panel["blocks_in_use"] > 0 and panel["requests_finished"] == 2
        assert panel["hit_tokens"] == stats.cached_tokens
