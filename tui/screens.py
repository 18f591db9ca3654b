"""Modal screens: help, start-up failure, yes/no questions, text and settings editors. Their
titles and messages quote names, errors and labs' words: shown inert (kvplay/inert.py), as Text."""
from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Input, Label, Markdown, Static, TextArea

from kvplay.inert import inert


def plain(text: str, lines: bool = True) -> Text:
    """A screen's title or message as inert Text: never parsed as markup."""
    return Text(inert(text, lines=lines, limit=4096))

HELP = """\
# kvplay — what you are looking at

Several users chat with **one** model that keeps **one** pool of KV-cache blocks.
A block holds the attention keys/values of *block size* tokens. When a prompt starts with
exactly the same tokens as something already in the pool (the shared system prompt, a common
question), those blocks are **reused** instead of computed again.

**Try it:** ask something as *alice*, then ask *bob* something. Bob's badge says how many of
his prompt tokens came from alice's blocks, and the map marks the reused blocks with `+`.

## The chat panes
Each user has a colour and a letter (`[A] alice`). Under every reply a badge:

`prompt 532 · cached 512 (alice 496, own 16) · TTFT 0.14 s · 18 tok/s`

* **prompt** – tokens in the whole prompt (system prompt + conversation so far)
* **cached** – of those, how many were found in the pool; in brackets, *whose* blocks they were
  (`own` = this user's earlier turns)
* **TTFT** – time to first token; **tok/s** – decoding speed of this reply

## The block map
The whole pool at a glance, whatever its size: each cell stands for a run of blocks, and the
line above the map says how many (`1 cell = 512 blocks`; small pools: one block per cell).
Colour and letter = the user who created most of the cell's blocks.

* `A` upper case on colour – **in use**: running requests read most of it now
* `a` lower case – **cached**: kept for reuse, evicted when space runs out
* faint `a` – fewer than half of the cell's blocks hold anything
* `·` – **free**; `∘` – other users' blocks while you filter by one user
* `a+` on a grey band – holds blocks the latest request reused (they flash white first)

In the map (ctrl+b, or click it): arrows move, `+`/`-` zoom in and out around the cursor down
to single blocks, `0` shows the whole pool again, `j` jumps to the blocks of the last request,
`/` shows one user's blocks (again: the next user, then everyone). The panel below shows what
the cell holds: for a run of blocks how many are in use, cached and free and who created them;
for a single block its hash, its tokens as text, creator, ref count, hits, age and users.

## Stats
* **hit rate** – share of all prompt tokens served from the cache
* **saved** – memory the sharing saves versus giving every user a private cache
* bars – one per request: `█` cached tokens in the creator's colour, `░` computed tokens
* TTFT sparklines per user – lower is better; cache hits make it drop
* timeline – every request at the time it was sent (the scrubber shows the same): `█` reused
  tokens in their creators' colours under `░` computed ones, each user's TTFT, `▲ now` on the right

## The prefix tree (ctrl+r)
What is cached, as text: the cached prompts as a tree, the shared system prompt one node with a
branch per conversation. Each line: the creator's letter, blocks and tokens, `→` the users who
reused it, hits, age, then the text. Beside it the block map marks the selected node's blocks `+`.
What changes animates: a stored node flashes `new` in its creator's colour, a reused one pulses
`reused by B`, an evicted one stays a moment struck through, then goes.
Keys: ↑/↓ move, → or Enter opens a node (the `+ N more branches` line lists the next ones),
← closes, `m` moves to the map where `f` finds the node of the block under the cursor, Esc closes.
Attached to a server (`kvplay attach`), the badges also say whether each turn's cached tokens
were the ones the mirror predicted. In the scrubber (`kvplay scrub`), `t` opens the tree at the
cursor and marks what that step stored, reused or evicted.

## Modes (F-keys or the command palette, ctrl+p)
* **isolation** – `shared` (everyone shares), `user` (each user private), `group`, `system`
  (only the system prompt is shared)
* **eviction** – which cached block goes first when the pool is full: `lru`, `lfu`, `fifo`
* **deterministic** – bitwise-identical results whether cached or not (needs an empty cache)

## Labs (command palette, type "lab:")
Each claim about shared caches, measured on this engine: **determinism** (cached vs cold vs
batched logits), **leak** (can another user tell a hit from their TTFT?), **collide** (hash
collisions with a truncated hash, verify-on-hit off and on), **response-cache** ("the first
user's answer is what everyone gets" — true of a response cache, not of a KV cache). A lab
clears the cache and switches modes while it runs, then shows its verdict.

## Keys
| key | what it does |
|---|---|
| Enter | send the message in this pane |
| Tab, alt+→ / alt+← | next / previous pane (ctrl+↓ / ctrl+↑ too) |
| ctrl+t | under 120 columns one pane shows at a time: switch to the cache panel and back (or click the tabs) |
| ctrl+b | move into the block map (arrows move, details below it) |
| ctrl+r | the prefix tree: what is cached as text, who made and who reused it (see above) |
| F2 / F3 | next isolation mode / eviction policy |
| F4 | clear the cache |
| F5 | deterministic mode on/off (asks first: it empties the cache) |
| F6 | edit the shared system prompt |
| F7 | seed, temperature, max tokens and group of this pane's user |
| F8 / F9 | add a user / remove this pane's user |
| F10 | show or hide the event log |
| F11 / F12 | pause or resume / play one turn (scripts and replays) |
| ctrl+s | save an SVG screenshot in kvplay's data folder, `~/.local/share/kvplay/screenshots/` on Linux (the toast names the file) |
| ctrl+p | command palette: every action as "category: action" |
| ctrl+q | quit |

Remap any key with binding ids, e.g. `KVPLAY_KEYMAP="mode.isolation=ctrl+o;cache.clear=ctrl+x" kvplay`
(ids: help, pane.next, pane.previous, view.cache, map.zoom_in, map.zoom_out, map.whole, map.jump, map.filter, mode.isolation, mode.eviction, cache.clear, mode.deterministic,
prompt.system, user.settings, user.add, user.remove, view.events, view.map, view.tree, replay.pause, replay.step,
app.screenshot, app.quit).

Press **Esc** to close.
"""


SCRUB_HELP = """\
# The scrubber — a recorded session's cache, at any point in time

The block map, stats, panes and event line show the pool as it stood after the event under the
cursor; the timeline below puts every request on the session's clock (the cursor is the ▲;
click to seek).

## Keys
| key | what it does |
|---|---|
| ← / → (h / l) | one event back / forward |
| [ / ] (shift+← / →) | one turn back / forward |
| space | play / pause; `s` (or 1 2 4 8) sets the speed |
| g | go to a turn |
| t | the prefix tree at the cursor: the cached prompts as text, who made and reused them, and what this step stored, reused or evicted (marked, still) |
| home / end | the first / last event |
| F1 | this help |
| Esc | close |

Press **Esc** to close.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,f1", "dismiss", "Close", id="help.close")]

    def __init__(self, text: str = HELP) -> None:
        super().__init__()
        self.text = text

    def compose(self):
        with VerticalScroll(id="help-box"):
            yield Markdown(self.text)


class LabScreen(ModalScreen):
    """A lab's tables and verdict, as `kvplay lab NAME` prints them."""

    BINDINGS = [Binding("escape,q", "dismiss", "Close", id="lab.close")]

    def __init__(self, title: str, parts: list) -> None:
        super().__init__()
        self.title_text, self.parts = title, parts

    def compose(self):
        with VerticalScroll(id="lab-box"):
            yield Static(plain(self.title_text), classes="title")
            for part in self.parts:
                yield Static(plain(part) if isinstance(part, str) else part)
            name = self.title_text.split(": ", 1)[-1]
            yield Static(plain(f"Esc closes. The same lab, with every option: kvplay lab {name} --help"), classes="hint")


class ErrorScreen(Screen):
    """Shown when the engine cannot start: what went wrong and how to fix it."""

    BINDINGS = [Binding("q,escape", "app.quit", "Quit", id="error.quit")]

    def __init__(self, error: str, fix: str) -> None:
        super().__init__()
        self.error, self.fix = error, fix

    def compose(self):
        with Vertical(id="error-box"):
            yield Static("kvplay could not start the model", classes="title")
            yield Static(plain(self.error), id="error-text")
            yield Static("How to fix it", classes="title")
            yield Static(plain(self.fix), id="error-fix")
            yield Static("Press q to quit.", classes="hint")


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("escape,n", "no", "No", id="confirm.no"), Binding("y", "yes", "Yes", id="confirm.yes")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self):
        with Vertical(classes="dialog"):
            yield Static(plain(self.question))
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", variant="warning", id="yes")
                yield Button("No (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)


class TextScreen(ModalScreen[str | None]):
    """Edit a longer text (the shared system prompt)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="text.cancel"),
                Binding("ctrl+s", "save", "Save", id="text.save")]

    def __init__(self, title: str, text: str) -> None:
        super().__init__()
        self.title_text, self.text = title, text

    def compose(self):
        with Vertical(classes="dialog wide"):
            yield Static(plain(self.title_text))
            yield TextArea(self.text, id="text-edit")
            with Horizontal(classes="buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel (esc)", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_save() if event.button.id == "save" else self.action_cancel()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text)

    def action_cancel(self) -> None:
        self.dismiss(None)


class FormScreen(ModalScreen[dict | None]):
    """A few labelled one-line fields; returns {name: text} or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="form.cancel")]

    def __init__(self, title: str, fields: list[tuple[str, str, str]]) -> None:
        super().__init__()
        self.title_text, self.fields = title, fields  # (name, label, value)

    def compose(self):
        with Vertical(classes="dialog"):
            yield Static(plain(self.title_text))
            for name, label, value in self.fields:
                yield Label(label)
                yield Input(value, id=f"field-{name}")
            yield Label("", id="form-error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("OK", variant="primary", id="ok")
                yield Button("Cancel (esc)", id="cancel")

    def values(self) -> dict:
        return {name: self.query_one(f"#field-{name}", Input).value for name, _, _ in self.fields}

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(self.values())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self.values() if event.button.id == "ok" else None)

    def action_cancel(self) -> None:
        self.dismiss(None)
