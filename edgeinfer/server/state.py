"""The server's one piece of shared state: the engine (loaded in the background, so /health
can answer 503 meanwhile), the admission checks every request passes, and the generations in
flight (aborted together on shutdown)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from starlette.requests import Request

from edgeinfer.errors import EdgeInferError
from edgeinfer.server import logs
from edgeinfer.server.admission import RateLimiter, check_queue
from edgeinfer.server.auth import KeyChecker
from edgeinfer.server.errors import APIError, bad_request
from edgeinfer.server.generate import Generation
from edgeinfer.server.grammar import Grammar, GrammarCompiler
from edgeinfer.server.metrics import Metrics
from edgeinfer.server.settings import ServerSettings


class ServerState:
    def __init__(self, settings: ServerSettings, logger: logging.Logger | None = None):
        self.settings = settings
        self.logger = logger or logging.getLogger(logs.LOGGER)
        self.keys = KeyChecker(list(settings.api_keys))
        self.limiter = (
            None
            if settings.rate_per_s is None
            else RateLimiter(settings.rate_per_s, settings.rate_burst)
        )
        self.engine = None  # an AsyncEngine once loaded
        self.load_error: BaseException | None = None
        self.metrics = Metrics(settings.model_name, self._stats)
        self.generations: set[Generation] = set()
        self.shutting_down = False
        self.stop_server: Callable[[], None] = lambda: None  # set by whoever runs the server
        self._grammars: GrammarCompiler | None = None
        self._longest_token: int | None = None  # bytes
        self._grammar_lock = asyncio.Lock()
        self._chat_template = None  # --chat-template-file's, compiled once the model is loaded

    def _stats(self):
        return None if self.engine is None else self.engine.stats()

    # -- lifecycle ---------------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, app):
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=self._load, args=(loop,), name="edgeinfer-load", daemon=True
        ).start()
        yield
        self.begin_shutdown()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    def _load(self, loop: asyncio.AbstractEventLoop) -> None:
        from edgeinfer.async_engine import AsyncEngine

        s = self.settings
        self.logger.info("loading %s", s.model)
        t0 = time.perf_counter()
        try:
            engine = AsyncEngine(s.model, **s.engine_kwargs)
        except BaseException as e:  # the CLI reports it once the server has stopped
            self.load_error = e
            loop.call_soon_threadsafe(self.stop_server)
            return
        self.engine = engine
        llm = engine.llm
        self.logger.info(
            "ready in %.1f s: %s, context %d tokens, %s",
            time.perf_counter() - t0,
            s.model_name,
            llm.max_context,
            llm.kv_report(),
        )

    def begin_shutdown(self) -> None:
        """Stop taking requests and abort those in flight (their clients get a 503 error)."""
        self.shutting_down = True
        for gen in list(self.generations):
            gen.abort()

    # -- admission ---------------------------------------------------------------------------

    def authenticate(self, request: Request) -> str | None:
        """-> the key's log name (None when the server has no keys); 401 otherwise."""
        if not self.keys.enabled:
            return None
        name = self.keys.check(request.headers.get("authorization"))
        if name is None:
            raise APIError(
                401,
                "missing or invalid API key: send Authorization: Bearer KEY",
                code="invalid_api_key",
            )
        return name

    def rate_limit(self, key: str | None, request: Request) -> None:
        if self.limiter is not None:
            client = request.client.host if request.client else "?"
            self.limiter.take(key or client)

    def ready(self):
        """-> the engine; 503 while the model loads or the server stops."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine is None:
            raise APIError(503, "the model is loading", code="loading", retry_after=5.0)
        return self.engine

    def check_model(self, name: str | None) -> None:
        s = self.settings
        if name is not None and name not in (s.model_name, s.model):
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server has {s.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_prompt_size(self, texts: list[str], param: str) -> None:
        """400 for text that must be more tokens than the context holds, before tokenizing it
        (which holds the event loop): no token is longer than the vocabulary's longest."""
        if self._longest_token is None:
            tok = self.engine.llm.tokenizer
            self._longest_token = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
        ctx = self.engine.llm.max_context
        for text in texts:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > ctx * self._longest_token:
                at_least = -(-size // self._longest_token)
                raise APIError(
                    400,
                    f"the prompt is at least {at_least} tokens but the context holds {ctx}",
                    param=param,
                    code="context_length_exceeded",
                )

    def admit(self) -> None:
        """503 when the waiting queue is full: sequences in flight beyond those running."""
        if self.settings.max_queue is None:
            return
        in_flight = sum(g.num_sequences for g in self.generations)
        check_queue(max(0, in_flight - self.engine.stats().running), self.settings.max_queue)

    def chat_template(self):
        """What chat requests are rendered with: --chat-template-file's template, else the
        model's (None: a base model, whose messages run as plain text)."""
        if self.settings.chat_template is None:
            return self.engine.llm.chat_template
        if self._chat_template is None:
            from edgeinfer.tokenizer.chat_template import ChatTemplate

            source, tokenizer = self.settings.chat_template, self.engine.llm.tokenizer
            self._chat_template = ChatTemplate.for_tokenizer(source, tokenizer)
        return self._chat_template

    def template_source(self) -> str | None:
        template = self.chat_template()
        return None if template is None else template.source

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Token ids of a conversation (off the event loop: a long one takes a while); a
        template that fails on it is a 400."""
        variables = {} if tools is None else {"tools": tools}
        requests = self.engine.llm.requests
        try:
            return await asyncio.to_thread(
                requests.chat_token_ids, messages, self.chat_template(), **variables
            )
        except EdgeInferError as e:
            raise bad_request(str(e), "messages") from None

    async def grammar(self, schema: dict | None = None, lark: str | None = None) -> Grammar:
        """Compile a JSON schema (response_format) or a Lark grammar (tools), off the event
        loop: llguidance may take a while."""
        async with self._grammar_lock:
            if self._grammars is None:
                tokenizer = self.engine.llm.tokenizer
                self._grammars = await asyncio.to_thread(GrammarCompiler, tokenizer)
        if lark is not None:
            return await asyncio.to_thread(self._grammars.compile_lark, lark, "tools")
        return await asyncio.to_thread(self._grammars.compile, schema)
