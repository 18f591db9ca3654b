"""What every lab shares: the result shape, tables, JSON, plots, progress and recording.

A lab is a function ``run(engine, params, ctx) -> LabResult``. ``LabContext`` carries the
optional session recorder and the progress reporter, so the same function serves the CLI and
the tests (which pass no context).
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table as RichTable
from rich.text import Text

from kvplay.inert import inert
from kvplay.options import pyplot, save_plot  # noqa: F401 (labs import pyplot from here)
from kvplay.sessions.recorder import Recorder
from kvplay.sessions.report import cached_cell, excerpt, fmt  # noqa: F401 (labs import them from here)
from kvplay.sessions.report import console as make_console


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class LabResult:
    lab: str
    verdict: str
    tables: list[Table] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    model: str = ""
    config: dict = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return _jsonable(asdict(self))


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        return _jsonable(x.item())
    return x


def renderables(result: LabResult) -> list:
    """The lab's tables, verdict and footer as rich renderables (the CLI prints them; the app
    shows them in a screen). What they quote (a model's answers, names) is inert Text."""
    out: list = []
    for t in result.tables:
        rt = RichTable(title=t.title, title_justify="left", header_style="bold")
        for c in t.columns:
            rt.add_column(c, overflow="fold")
        for row in t.rows:
            rt.add_row(*[Text(inert(fmt(v))) for v in row])
        out.append(rt)
    out.append(Panel(Text(inert(result.verdict, lines=True)), title=f"verdict: {result.lab}", border_style="green"))
    out.append(Text(f"{inert(result.model)} · {result.elapsed_s:.1f} s", style="dim"))
    return out


def render(result: LabResult, console=None) -> None:
    """Print the lab's tables and verdict with rich."""
    console = console or make_console(width=140)
    for r in renderables(result):
        console.print(r)


def token_pool(tokenizer) -> list[int]:
    """Every token id of `tokenizer` but its special ones: what random prompts are drawn from."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(len(tokenizer)) if i not in special]


def quoted(text: str) -> str:
    """A model's answer inside a sentence or a cell: in quotes, on one line."""
    return f"“{excerpt(text, 400)}”"


def emit(result: LabResult, as_json: bool, plot_path: str | None = None, draw=None) -> None:
    """A result on stdout (JSON, or tables and verdict), and its plot when asked for:
    `draw(result, path)` draws it."""
    if as_json:
        dump_json(result)
    else:
        render(result)
    if plot_path:
        save_plot(lambda path: draw(result, path), plot_path)


def dump_json(result: LabResult, out=None) -> None:
    out = out or sys.stdout
    json.dump(result.to_dict(), out, indent=2)
    out.write("\n")


class Progress:
    """Progress lines on stderr: a rich bar on a terminal, plain lines (at most every 2 s)
    otherwise, both with an estimate of the time left. `prefix` names what runs ("lab NAME")."""

    def __init__(self, lab: str, enabled: bool = True, stream=None, prefix: str | None = None):
        self.lab = lab
        self.prefix = prefix if prefix is not None else f"lab {lab}"
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._last = 0.0
        self._start = time.monotonic()
        self._bar = None
        self._task = None
        self._tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()

    def phase(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, max(1, total), 0
        self._start = time.monotonic()
        if not self.enabled:
            return
        if self._tty:
            if self._bar is None:
                self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                         TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                         console=Console(file=self.stream), transient=True)
                self._bar.start()
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task = self._bar.add_task(f"{self.prefix}: {label}", total=self.total)
        else:
            print(f"{self.prefix}: {label} (0/{self.total})", file=self.stream, flush=True)
            self._last = time.monotonic()

    def eta(self) -> str:
        """The time left at the pace so far, as "1m05s" ("?" before the first step)."""
        if not self.done:
            return "?"
        left = (time.monotonic() - self._start) / self.done * max(0, self.total - self.done)
        m, s = divmod(int(left + 0.5), 60)
        return f"{m}m{s:02d}s" if m else f"{s}s"

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
        elif time.monotonic() - self._last > 2.0 or self.done >= self.total:
            print(f"{self.prefix}: {self.label} ({self.done}/{self.total}, ETA {self.eta()})", file=self.stream,
                  flush=True)
            self._last = time.monotonic()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class LabContext:
    """Progress + optional session recording for one lab run."""

    def __init__(self, progress: Progress | None = None, recorder=None):
        self.progress = progress or Progress("", enabled=False)
        self.recorder = recorder
        self.record_errors = 0

    def phase(self, label: str, total: int) -> None:
        self.progress.phase(label, total)

    def advance(self, n: int = 1) -> None:
        self.progress.advance(n)

    def record(self, user: str, messages: list[dict], sampling, result) -> None:
        if self.recorder is None or result is None:
            return
        text = messages[-1].get("content", "") if messages else ""
        try:
            self.recorder.record_turn(user, text, messages, sampling, result)
        except Exception:  # recording is a side channel: never fail the measurement
            self.record_errors += 1


def open_recorder(db_path: str | None, config, model_name: str, lab: str, engine):
    """A session recorder attached to `engine`."""
    rec = Recorder.open(db_path, config, model_name, source=f"lab:{lab}", system_prompt="")
    rec.attach(engine)
    return rec


def token_messages(tokenizer, prompt_ids: list[int]) -> list[dict]:
    """Messages to record for a raw-token request (what the client sent, decoded)."""
    return [{"role": "user", "content": tokenizer.decode(prompt_ids)}]
