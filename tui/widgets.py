"""The chat screen's widgets: the conversation pane and the stats panel."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.widgets import Markdown, Sparkline, Static

from edgeinfer.units import human_bytes

from .session import ModelInfo
from .stats import StatsView


class UserTurn(Vertical):
    def __init__(self, text: str):
        super().__init__(classes="turn user")
        self._text = text

    def compose(self) -> ComposeResult:
        yield Static("You", classes="role")
        yield Static(Content(self._text), classes="body")


class AssistantTurn(Vertical):
    """A reply; its Markdown grows as text arrives (the app batches the appends)."""

    def __init__(self, label: str):
        super().__init__(classes="turn assistant")
        self._label = label

    def compose(self) -> ComposeResult:
        yield Static(self._label, classes="role")
        yield Markdown(classes="body")

    async def append(self, text: str) -> None:
        pane = self.parent
        follow = isinstance(pane, ConversationPane) and pane.at_end
        await self.query_one(Markdown).append(text)
        if follow:
            pane.follow(True)

    def mark(self, note: str) -> None:
        """A short line under the reply: why it ended early."""
        pane = self.parent
        follow = isinstance(pane, ConversationPane) and pane.at_end
        self.mount(Static(Content(note), classes="note"))
        if follow:
            pane.follow(True)


class Notice(Static):
    """A line from the app itself (mode notices, errors, command results)."""

    def __init__(self, text: str, kind: str = "info", markdown: bool = False):
        super().__init__(classes=f"notice {kind}")
        self._text = text
        self._markdown = markdown

    def compose(self) -> ComposeResult:
        if self._markdown:
            yield Markdown(self._text)

    def on_mount(self) -> None:
        if not self._markdown:
            self.update(Content(self._text))


class ConversationPane(VerticalScroll):
    """Scroll-back of turns; it follows new text unless the user scrolled up."""

    can_focus = False

    async def add(self, widget) -> None:
        follow = self.at_end
        await self.mount(widget)
        self.follow(follow)

    @property
    def at_end(self) -> bool:
        return self.scroll_y >= self.max_scroll_y - 1

    def follow(self, was_at_end: bool) -> None:
        """Keep the newest line in view after a change, if it was in view before."""
        if was_at_end:
            self.call_after_refresh(self.scroll_end, animate=False)

    async def clear(self) -> None:
        await self.remove_children()


class StatsPanel(Vertical):
    """Model facts and live generation numbers; `show(view)` redraws it."""

    def __init__(self, info: ModelInfo):
        super().__init__(id="stats")
        self._info = info

    def compose(self) -> ComposeResult:
        info = self._info
        mode = "chat" if info.chat else "completion"
        yield Static(Content(info.name), classes="title")
        yield Static(Content(f"{info.quant} · {info.arch} · {mode}"), classes="dim")
        yield Static(id="rate")
        yield Sparkline([], id="spark")
        yield Static(id="numbers")

    def show(self, v: StatsView) -> None:
        label = "now" if v.generating else "avg"
        rate = "–" if v.rate is None else f"{v.rate:.1f}"
        # fixed-height lines (app.tcss): repaint only, no layout pass on every refresh
        self.query_one("#rate", Static).update(
            Content.from_markup("[b]$rate[/b] tok/s $label", rate=rate, label=label), layout=False
        )
        spark = self.query_one("#spark", Sparkline)
        spark.data = list(v.history)
        visible = len(v.history) >= 2  # one value would draw as a full bar
        if spark.visible != visible:
            spark.visible = visible
        p = v.progress
        rows = [
            ("TTFT", _ms(p.ttft_s if p else None)),
            ("TPOT", _ms(p.tpot_s if p else None)),
            ("prompt", f"{p.prompt_tokens - p.cached_tokens} new" if p else "–"),
            ("reused", f"{p.cached_tokens} cached" if p else "–"),
            ("output", f"{p.generated} tok" if p else "–"),
            ("context", f"{v.context_used}/{v.context_max}"),
            ("KV", f"{v.kv_blocks[0]}/{v.kv_blocks[1]} blk" if v.kv_blocks else "n/a"),
            ("cache", f"{v.kv_blocks[2]} blk" if v.kv_blocks else "n/a"),
            *(
                [("window", f"{v.window_blocks[0]}/{v.window_blocks[1]} blk")]
                if v.window_blocks
                else []
            ),
            *([("draft", _drafts(*v.drafts))] if v.drafts else []),
            ("RSS", human_bytes(v.rss_bytes)),
            ("CPU", f"{v.cpu_percent:.0f}% · {self._info.threads} thr"),
        ]
        width = max(len(k) for k, _ in rows)
        self.query_one("#numbers", Static).update(
            Content("\n".join(f"{k:<{width}} {val}" for k, val in rows)), layout=False
        )


def _drafts(drafts: int, proposed: int, accepted: int) -> str:
    """Speculative decoding: the share of draft tokens accepted, and how many per draft."""
    if not drafts:
        return "–"
    return f"{accepted / proposed:.0%} · {accepted / drafts:.1f}/step"


def _ms(s: float | None) -> str:
    return "–" if s is None else f"{s * 1000:.0f} ms"
