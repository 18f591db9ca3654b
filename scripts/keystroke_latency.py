"""Keystroke latency in the app at N pool blocks while three users stream replies non-stop (tiny
model): from pressing a key in a fourth user's input to that input drawing the character.
A measurement, not a test: `python scripts/keystroke_latency.py 1000000` (default 1M blocks)."""
import asyncio, statistics, sys, time
from kvplay.engine.config import EngineConfig
from kvplay.engine.model import load_model
from kvplay.sessions.script import UserSpec
from kvplay.tui.app import KvplayApp
from textual.widgets import Input

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
loaded = load_model("tiny:llama", device="cpu", dtype="float32")
drawn = {}
orig = Input.render_line
def render_line(self, y):
    strip = orig(self, y)
    v = self.value
    if v and v not in drawn:
        drawn[v] = time.perf_counter()
    return strip
Input.render_line = render_line

async def main():
    t0 = time.perf_counter()
    app = KvplayApp(EngineConfig(model="tiny:llama", num_blocks=N), [UserSpec(u, max_tokens=400) for u in ("alice", "bob", "carol", "dave")],
                    "You are a helpful assistant. " * 8, loaded=loaded, record=False, timings=True)
    async with app.run_test(size=(160, 48)) as pilot:
        while app.engine is None:
            await pilot.pause(0.05)
        print(f"engine ready in {time.perf_counter() - t0:.1f} s at {N:,} blocks", flush=True)
        for u in ("alice", "bob", "carol"):
            p = app.pane(u); p.input.value = f"Tell me a long story number {u}"; p.input.focus(); await pilot.press("enter")
        await pilot.pause(0.2)
        stop = False
        async def keep_streaming():
            k = 0
            while not stop:
                for u in ("alice", "bob", "carol"):
                    p = app.pane(u)
                    if not p.busy:
                        k += 1
                        del p.history[:-2]  # stay inside the tiny model's context
                        app.chat.send(p, f"Tell me a long story, part {k}")
                await asyncio.sleep(0.01)
        feeder = asyncio.create_task(keep_streaming())
        await pilot.pause(0.3)
        dave = app.pane("dave"); dave.input.focus()
        lat = []
        typed = ""
        busy_keys = 0
        while len(lat) < 40 and (app.busy or len(lat) < 5):
            busy_keys += app.busy
            c = "abcdefghij"[len(lat) % 10]
            typed += c
            t = time.perf_counter()
            await pilot.press(c)
            while typed not in drawn and time.perf_counter() - t < 2:
                await asyncio.sleep(0.001)
            lat.append((drawn.get(typed, time.perf_counter()) - t) * 1000)
            await asyncio.sleep(0.05)
        stop = True
        await feeder
        steps = app.engine.stats()
        lat.sort()
        print(f"{len(lat)} keystrokes ({busy_keys} while streaming): median {statistics.median(lat):.1f} ms, "
              f"p90 {lat[int(len(lat) * 0.9) - 1]:.1f} ms, max {lat[-1]:.1f} ms; map 1 cell = {app.query_one('#map').bpc} blocks")
        while app.busy:
            await pilot.pause(0.1)
        toks = [r.decode_tok_s for r in app.cache.requests if r.decode_tok_s]
        failed = sum(len(p.chat.texts("error")) for p in app.panes)
        print(f"{len(app.cache.requests)} replies while typing ({failed} failed), decode tok/s median "
              f"{statistics.median(toks):.0f}; output tokens {sum(r.output_tokens for r in app.cache.requests)}")
asyncio.run(main())
