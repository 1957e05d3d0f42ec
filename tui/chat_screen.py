"""The chat screen: conversation, stats panel, input line, slash commands."""

from __future__ import annotations

from time import perf_counter, thread_time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, Header, Input

from edgeinfer.errors import EdgeInferError

from . import commands, transcript
from .session import SETTABLE, ChatSession, ContextFullError
from .stats import LiveStats
from .widgets import AssistantTurn, ConversationPane, Notice, StatsPanel, UserTurn

# Text and stats refresh at most this often while a reply streams: a few Markdown appends a
# second read smoother than one per token. Each refresh costs a layout and a repaint on the UI
# thread, which competes with generation for the GIL and the cores, so a refresh also waits
# until the UI thread has used no more than UI_BUDGET of one core since the last one (a long
# reply re-wraps more text per refresh and so refreshes less often), but never longer than
# MAX_REFRESH_S.
REFRESH_S = 0.25
UI_BUDGET = 0.04
MAX_REFRESH_S = 1.0
IDLE_REFRESH_S = 1.0  # RSS and CPU keep moving while idle, slowly
MIN_WIDTH_FOR_STATS = 60
# what a full context leaves the user: llama.cpp's context shift, or a clear start
CONTEXT_CHOICES = (
    "Type /shift to drop the oldest turns and go on, or /clear (Ctrl+L) to start anew."
)


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop reply"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("pageup", "page_up", "Scroll", show=False),
        Binding("pagedown", "page_down", "Scroll", show=False),
    ]

    def __init__(self, session: ChatSession, load_s: float | None = None):
        super().__init__(id="chat")
        self.title = "edgeinfer"
        self.sub_title = f"{session.info.name} · {session.info.quant}"
        self.session = session
        self.live = LiveStats()
        self.stats_on = True
        self._load_s = load_s
        self._streaming: AssistantTurn | None = None
        self._last_refresh = 0.0
        self._cpu_at_refresh = 0.0

    # ---- layout -------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(icon="")
        with Horizontal(id="main"):
            yield ConversationPane(id="conversation")
            yield StatsPanel(self.session.info)
        yield Input(placeholder="Message · Enter sends · /help for commands", id="prompt")
        yield Footer()

    async def on_mount(self) -> None:
        info = self.session.info
        took = "" if self._load_s is None else f" in {self._load_s:.1f} s"
        await self._notice(
            f"{info.name} ({info.quant}) loaded{took}. Type a message; /help lists the commands."
        )
        await self._mode_notice()
        self._show_stats()
        self.set_interval(REFRESH_S, self._tick)
        self.query_one(Input).focus()  # last: once it has focus, the screen is ready

    def on_resize(self) -> None:
        self._show_stats()

    def _show_stats(self) -> None:
        panel = self.query_one(StatsPanel)
        show = self.stats_on and self.size.width >= MIN_WIDTH_FOR_STATS
        if panel.display != show:
            panel.display = show
        if show:
            panel.show(self.live.view(self.session))

    # ---- sending and streaming ----------------------------------------------------------

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        line = event.value.strip()
        if not line:
            return
        try:
            cmd = commands.parse(line)
            if cmd is not None:
                event.input.clear()
                await getattr(self, f"_cmd_{cmd.name}")(cmd.arg)
                return
            if self.replying:
                self.notify("Still replying: Esc stops the reply.", severity="warning")
                return
            text = commands.message_text(line)
            reply = self.session.start(text)
        except ContextFullError as e:
            await self._notice(f"Context full: {e}. {CONTEXT_CHOICES}", "warning")
            return
        except EdgeInferError as e:
            await self._error(str(e))
            return
        event.input.clear()
        pane = self.query_one(ConversationPane)
        await pane.add(UserTurn(text))
        self._streaming = AssistantTurn("Assistant" if self.session.info.chat else "Completion")
        await pane.add(self._streaming)
        self.app.compute.submit(reply.run)

    async def _tick(self) -> None:
        now, cpu = perf_counter(), thread_time()
        since = now - self._last_refresh
        reply = self.session.reply
        if self._streaming is None or reply is None:
            if since >= IDLE_REFRESH_S:
                self._last_refresh, self._cpu_at_refresh = now, cpu
                self._show_stats()
            return
        done = reply.done.is_set()
        over_budget = cpu - self._cpu_at_refresh > UI_BUDGET * since
        if not done and over_budget and since < MAX_REFRESH_S:
            return
        self._last_refresh, self._cpu_at_refresh = now, cpu
        with self.app.batch_update():  # one repaint for the new text and numbers together
            text = reply.take_text()
            if text:
                await self._streaming.append(text)
            if done:
                await self._finish()
            self._show_stats()

    async def _finish(self) -> None:
        reply = self.session.finish()
        turn, self._streaming = self._streaming, None
        rest = reply.take_text()
        if rest:
            await turn.append(rest)
        if reply.finish_reason == "abort":
            turn.mark("stopped (Esc)")
        elif reply.error is not None:
            turn.mark("failed")
            await self._error(reply.error)
        elif self.session.context_full():
            await self._notice(
                f"Context full: the conversation fills the model's context. {CONTEXT_CHOICES}",
                "warning",
            )
        elif reply.finish_reason == "length":
            turn.mark(f"stopped at max_tokens={self.session.params.max_tokens} (/set max_tokens N)")
        elif not reply.text:
            turn.mark("(empty reply)")

    @property
    def replying(self) -> bool:
        """A reply is on screen and not yet finished (its thread may already be done; the
        next tick records it)."""
        return self._streaming is not None

    def action_stop(self) -> None:
        if self.replying:
            self.session.reply.cancel()

    async def action_clear(self) -> None:
        try:
            await self._cmd_clear("")
        except EdgeInferError as e:
            await self._error(str(e))

    def action_page_up(self) -> None:
        self.query_one(ConversationPane).scroll_page_up()

    def action_page_down(self) -> None:
        self.query_one(ConversationPane).scroll_page_down()

    def stop_generation(self, timeout_s: float = 5.0) -> None:
        """Cancel a reply in flight and wait (briefly) for its thread to let go of the model."""
        reply = self.session.reply
        if reply is not None and not reply.done.is_set():
            reply.cancel()
            reply.done.wait(timeout_s)

    # ---- slash commands (one method per name in commands.COMMANDS) ---------------------

    async def _cmd_clear(self, arg: str) -> None:
        if self.replying:
            raise EdgeInferError("a reply is still running: Esc stops it, then /clear")
        self.session.clear()
        self.live.history.clear()
        await self.query_one(ConversationPane).clear()
        await self._notice("New conversation.")
        await self._mode_notice()
        self._show_stats()

    async def _cmd_shift(self, arg: str) -> None:
        if self.replying:
            raise EdgeInferError("a reply is still running: Esc stops it, then /shift")
        dropped = self.session.shift()
        used = len(self.session.llm.chat_token_ids(self.session.messages())) if dropped else 0
        await self._notice(
            f"Dropped the {dropped} oldest turns: the model now sees {used} of "
            f"{self.session.info.max_context} tokens (they stay on screen)."
            if dropped
            else "Nothing to drop: the conversation already takes at most half the context."
        )
        self._show_stats()

    async def _cmd_system(self, arg: str) -> None:
        if not arg:
            current = self.session.system
            await self._notice(f"System prompt: {current}" if current else "No system prompt.")
            return
        self.session.system = None if arg == "-" else arg
        what = "removed" if arg == "-" else "set"
        await self._notice(f"System prompt {what}; it applies from the next reply.")

    async def _cmd_set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        if not value.strip():
            p = self.session.params
            now = ", ".join(f"{k} = {getattr(p, k)}" for k in SETTABLE)
            await self._notice(f"Usage: /set NAME VALUE. Now: {now}")
            return
        params = self.session.set_param(name.lower(), value.strip())
        await self._notice(f"{name.lower()} = {getattr(params, name.lower())}")

    async def _cmd_save(self, arg: str) -> None:
        if not arg:
            raise EdgeInferError("usage: /save FILE.md or /save FILE.json")
        path = transcript.save(self.session, arg)
        await self._notice(f"Saved the transcript to {path}")

    async def _cmd_stats(self, arg: str) -> None:
        self.stats_on = not self.stats_on
        self._show_stats()
        info = self.session.info
        bpw = (
            "" if info.bits_per_weight is None else f", {info.bits_per_weight:.2f} bits per weight"
        )
        types = f" ({info.tensor_types})" if info.tensor_types else ""
        panel = "shown" if self.stats_on else "hidden"
        where = f" {info.placement}." if info.placement else ""
        await self._notice(f"{info.name}: {info.quant}{bpw}{types}.{where} Stats panel {panel}.")

    async def _cmd_help(self, arg: str) -> None:
        await self.query_one(ConversationPane).add(
            Notice(commands.help_markdown(), "help", markdown=True)
        )

    # ---- notices ------------------------------------------------------------------------

    async def _mode_notice(self) -> None:
        if not self.session.info.chat:
            await self._notice(
                "This is a base model without a chat template: completion mode. "
                "The model continues the conversation's text as plain text.",
                "warning",
            )

    async def _notice(self, text: str, kind: str = "info") -> None:
        await self.query_one(ConversationPane).add(Notice(text, kind))

    async def _error(self, text: str) -> None:
        await self._notice(f"error: {text}", "error")
        self.notify(text, severity="error", title="error")
