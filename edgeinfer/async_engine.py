"""`AsyncEngine`: the continuous-batching engine behind an asyncio API, for the TUI and a server.

One background thread owns the model: it loads it, then loops schedule -> run -> postprocess
while requests are unfinished and sleeps otherwise (Numba's thread pool must always be entered
from the same thread). asyncio code talks to it through a queue of commands; outputs come back
through `loop.call_soon_threadsafe` into one asyncio.Queue per request.

    engine = AsyncEngine("smollm2-135m-instruct")
    async for out in engine.add_request([{"role": "user", "content": "Hi"}], params):
        print(out.text, end="")
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from edgeinfer.engine.engine import EngineStats
from edgeinfer.engine.outputs import Metrics, TokenLogprob
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.engine.sequence import Sequence
from edgeinfer.errors import EdgeInferError

__all__ = ["AsyncEngine", "RequestOutput"]


@dataclass(frozen=True)
class RequestOutput:
    """One delta of a request: the text and token ids produced since the previous one."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last output: 'stop' | 'length' | 'abort'
    metrics: Metrics | None  # on the last output of a request that produced a token
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens reused from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per token id, when params.logprobs is set

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Request:
    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop):
        self.seq = seq
        self.loop = loop
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.sent_tokens = 0  # output tokens already delivered


class AsyncEngine:
    """Load `model` on the engine thread (the constructor waits for it and re-raises a load
    error); keyword arguments are `LLM`'s: an `EngineConfig` or its fields."""

    def __init__(self, model: str, **llm_kwargs):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._requests: dict[str, _Request] = {}
        self._stopping = False
        self._stats: EngineStats | None = None
        self._load_error: BaseException | None = None
        loaded = threading.Event()
        self._thread = threading.Thread(
            target=self._main,
            args=(model, llm_kwargs, loaded),
            name="edgeinfer-engine",
            daemon=True,
        )
        self._thread.start()
        loaded.wait()
        if self._load_error is not None:
            raise self._load_error

    # -- public API (any thread; add_request inside a running event loop) ---------------------

    def add_request(
        self,
        prompt: str | list[int] | list[dict],
        params: SamplingParams | None = None,
        priority: int = 0,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a completion (text or token ids) or a chat (a list of messages) -> an async
        iterator of its outputs. Higher `priority` runs first and may preempt lower ones.
        Closing or cancelling the iteration aborts the request and frees its KV blocks.
        Bad input raises here (PromptError, RequestTooLargeError, ...)."""
        if self._stopping:
            raise EdgeInferError("the engine is shut down")
        seq = self.llm.requests.from_prompt(
            prompt, params, priority=priority, request_id=request_id
        )
        if seq.request_id in self._requests:
            raise EdgeInferError(f"request id {seq.request_id!r} is already in use")
        request = _Request(seq, asyncio.get_running_loop())
        self._requests[seq.request_id] = request
        self._send("add", request)
        return self._outputs(request)

    def abort(self, request_id: str) -> None:
        """Stop a request before its next step; its iterator ends with finish_reason 'abort'.
        Unknown or finished ids are ignored."""
        request = self._requests.get(request_id)
        if request is not None:
            request.seq.aborted = True
            self._wake.set()

    def stats(self) -> EngineStats:
        """Running/waiting requests, KV blocks, prefix-cache hits, tokens/s, as of the last
        step (cheap: a snapshot the engine thread keeps up to date)."""
        return self._stats

    def shutdown(self) -> None:
        """Abort every request and stop the engine thread."""
        self._stopping = True
        self._send("stop", None)
        self._thread.join()

    # -- engine thread -------------------------------------------------------------------------

    def _send(self, command: str, payload) -> None:
        self._commands.put((command, payload))
        self._wake.set()

    async def _outputs(self, request: _Request) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await request.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not request.seq.finished:
                self.abort(request.seq.request_id)

    def _main(self, model, llm_kwargs, loaded: threading.Event) -> None:
        from edgeinfer.llm import LLM

        try:
            self.llm = LLM(model, **llm_kwargs)
            self.engine = self.llm.engine
            self._stats = self.engine.stats()
        except BaseException as e:  # re-raised by the constructor, in the caller's thread
            self._load_error = e
            return
        finally:
            loaded.set()
        while True:
            if not self._run_commands():
                break
            if self.engine.has_unfinished:
                self._step()
                if self.engine.wait_s:
                    self._wake.wait(self.engine.wait_s)
            else:
                self._stats = self.engine.stats()
                self._wake.wait()
        for request in list(self._requests.values()):
            request.seq.aborted = True
        self._step()

    def _run_commands(self) -> bool:
        self._wake.clear()
        while True:
            try:
                command, request = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command == "stop":
                return False
            try:
                self.engine.add(request.seq)
            except Exception as e:
                self._finish(request, e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug or a resource error: fail the requests, keep serving
            for request in list(self._requests.values()):
                if not request.seq.finished:
                    self.engine.abort(request.seq)
                self._finish(request, e)
            return
        self._stats = self.engine.stats()  # before delivering: readers see the step's effect
        for seq, delta in outputs:
            request = self._requests.get(seq.request_id)
            if request is not None:
                self._deliver(request, delta)

    def _deliver(self, request: _Request, delta: str) -> None:
        seq = request.seq
        sent = request.sent_tokens
        tokens = seq.output_token_ids[sent:]
        request.sent_tokens += len(tokens)
        finished = seq.finished
        output = RequestOutput(
            request_id=seq.request_id,
            text=delta,
            token_ids=tokens,
            finish_reason=seq.finish_reason,
            metrics=Metrics.from_sequence(seq) if finished and seq.t_first_token else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=None if seq.logprobs is None else seq.logprobs[sent:],
        )
        if finished:
            self._finish(request, output)
        else:
            self._put(request, output)

    def _finish(self, request: _Request, item) -> None:
        self._requests.pop(request.seq.request_id, None)
        self._put(request, item)

    def _put(self, request: _Request, item) -> None:
        try:
            request.loop.call_soon_threadsafe(request.outputs.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            request.seq.aborted = True
