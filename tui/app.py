"""`edgeinfer chat`: the Textual app. It loads the model behind a loading screen, then chats."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass, field
from time import perf_counter

from textual.app import App
from textual.binding import Binding

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.hub import DEFAULT_MODEL

from . import session as sessions
from .chat_screen import ChatScreen
from .compute import ComputeThread
from .loading import LoadingScreen


@dataclass(frozen=True)
class ChatOptions:
    model: str = DEFAULT_MODEL
    threads: int | None = None
    ctx: int | None = None
    system: str | None = None
    params: SamplingParams = field(
        default_factory=lambda: SamplingParams(max_tokens=sessions.DEFAULT_MAX_TOKENS)
    )
    knobs: dict = field(default_factory=dict)  # more EngineConfig knobs (--spec, --spec-k)


class ChatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "edgeinfer"
    ENABLE_COMMAND_PALETTE = False  # slash commands and /help take the place of ctrl+p
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, options: ChatOptions | None = None, loaded: tuple | None = None):
        """loaded: an already loaded (llm, ModelInfo) pair, which skips the loading screen."""
        super().__init__()
        self.options = options or ChatOptions()
        self._loaded = loaded
        # why loading failed (shown on the loading screen); `edgeinfer chat` exits 2 with it
        self.load_error: str | None = None
        self.compute = ComputeThread()  # the model's one thread: loading, warm-up, replies

    def on_mount(self) -> None:
        # A closed terminal (SSH dropped, tmux pane killed) sends SIGHUP: quit as ctrl+q does,
        # stopping the reply, instead of living on with no screen.
        with contextlib.suppress(NotImplementedError, AttributeError):  # no SIGHUP on Windows
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGHUP, lambda: asyncio.ensure_future(self.action_quit())
            )
        if self._loaded is not None:
            self._start_chat(*self._loaded, load_s=None)
            return
        self.push_screen(LoadingScreen(self.options.model))
        self.compute.submit(self._load)

    @property
    def chat(self) -> ChatScreen | None:
        return self.screen if isinstance(self.screen, ChatScreen) else None

    def _load(self) -> None:
        """Compute thread: pull, load, warm up; every step is reported on the loading screen."""
        o = self.options
        t0 = perf_counter()
        try:
            llm, info = sessions.load(o.model, o.threads, o.ctx, self._report, **o.knobs)
        except EdgeInferError as e:
            self._from_thread(self._fail, str(e))
            return
        except Exception as e:  # a bug: say so on screen rather than dumping a traceback
            self._from_thread(self._fail, f"internal error: {type(e).__name__}: {e}")
            return
        self._from_thread(self._start_chat, llm, info, perf_counter() - t0)

    def _report(self, message: str, fraction: float | None) -> None:
        self._from_thread(lambda: self._loading_step(message, fraction))

    def _loading_step(self, message: str, fraction: float | None) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.screen.step(message, fraction)

    def _fail(self, message: str) -> None:
        self.load_error = message
        if isinstance(self.screen, LoadingScreen):
            self.screen.fail(message)

    def _from_thread(self, fn, *args) -> None:
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:  # the app has already exited (the user quit while loading)
            pass

    def _start_chat(self, llm, info, load_s: float | None) -> None:
        o = self.options
        session = sessions.ChatSession(llm, info, o.system, o.params)
        screen = ChatScreen(session, load_s)
        if isinstance(self.screen, LoadingScreen):
            self.switch_screen(screen)
        else:
            self.push_screen(screen)

    async def action_quit(self) -> None:
        if self.chat is not None:
            self.chat.stop_generation()
        self.exit()
