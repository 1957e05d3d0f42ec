"""The screen shown while the model is pulled, loaded and warmed up (in a worker thread)."""

from __future__ import annotations

from time import perf_counter

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, ProgressBar, Static

MAX_LINES = 8  # a pull reports several steps; older ones scroll off


class LoadingScreen(Screen):
    """Steps as they happen, with their durations, and a bar for the current one.

    `step(message, fraction)` comes from the loader thread through `call_from_thread`:
    a new message finishes the previous step, a fraction (0..1) moves the bar.
    """

    def __init__(self, model: str):
        super().__init__(id="loading")
        self._model = model
        self._lines: list[tuple[str, float, float | None]] = []  # message, start, seconds taken

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static(Content.from_markup("[b]edgeinfer[/b] · $m", m=self._model), id="title")
            yield Static(id="steps")
            yield ProgressBar(total=None, show_eta=False, id="bar")
            yield Static(id="error")
        yield Footer()

    def step(self, message: str, fraction: float | None = None) -> None:
        now = perf_counter()
        if not self._lines or self._lines[-1][0] != message:
            if self._lines and self._lines[-1][2] is None:
                text, start, _ = self._lines[-1]
                self._lines[-1] = (text, start, now - start)
            self._lines.append((message, now, None))
            self._lines = self._lines[-MAX_LINES:]
        bar = self.query_one(ProgressBar)
        if fraction is None:
            bar.update(total=None)
        else:
            bar.update(total=100, progress=100 * fraction)
        self._draw()

    def fail(self, message: str) -> None:
        self.query_one(ProgressBar).display = False
        error = self.query_one("#error", Static)
        error.display = True
        error.update(Content.from_markup("[b]error:[/b] $m\n\nCtrl+Q quits.", m=message))

    def _draw(self) -> None:
        rows = []
        for i, (text, _, took) in enumerate(self._lines):
            last = i == len(self._lines) - 1
            mark = "…" if last and took is None else "✓"
            rows.append(f"{mark} {text}" + ("" if took is None else f"  ({took:.1f} s)"))
        self.query_one("#steps", Static).update(Content("\n".join(rows)))
