"""One HTTP request's engine requests: every prompt times `n` choices, their outputs merged.

The first choice of each prompt starts at once; its siblings start when it has produced its
first token, so that the prompt's K/V is in the prefix cache and they share its blocks instead
of computing it n times. Bad input raises from `start` (before any response is sent).
Closing the iteration (a disconnect) or `abort` (server shutdown) aborts every engine request
of the generation, which frees its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from edgeinfer.async_engine import AsyncEngine, RequestOutput
from edgeinfer.engine.outputs import TokenLogprob
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError
from edgeinfer.server.errors import APIError, bad_request
from edgeinfer.server.metrics import Metrics


@dataclass
class Choice:
    """What one sequence has produced so far."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    t_last: float | None = None
    closed: bool = False  # abandoned before it finished


class Generation:
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: Metrics,
        prompts: list,
        n: int,
        params: Callable[[int], SamplingParams],
        priority: int,
        prompt_param: str = "prompt",
    ):
        self.id = uuid.uuid4().hex
        self.t_arrival = time.perf_counter()
        self.t_first_token: float | None = None
        self._engine = engine
        self._metrics = metrics
        self._prompts = prompts
        self._n = n
        self._params = params
        self._priority = -priority  # vLLM's priority: lower runs first; the engine's: higher
        self._prompt_param = prompt_param  # the request field bad prompts are blamed on
        self.choices = [Choice(i, i // n) for i in range(len(prompts) * n)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task] = {}
        self.aborted = False  # by the server (shutdown), not by the client

    @property
    def num_sequences(self) -> int:
        return len(self.choices)

    def engine_ids(self) -> list[str]:
        return [self._engine_id(i) for i in self._tasks]

    def _engine_id(self, index: int) -> str:
        return f"{self.id}-{index}"

    def start(self) -> None:
        """Queue the first choice of every prompt; bad prompts raise APIError (400)."""
        try:
            for p in range(len(self._prompts)):
                self._start(p * self._n)
        except BaseException:
            self.close()
            raise

    def _start(self, index: int) -> None:
        choice = self.choices[index]
        try:
            stream = self._engine.add_request(
                self._prompts[choice.prompt_index],
                self._params(index),
                self._priority,
                self._engine_id(index),
            )
        except EdgeInferError as e:  # empty, too long, out-of-vocab ids, too big for the cache
            raise bad_request(str(e), self._prompt_param) from None
        self._tasks[index] = asyncio.create_task(self._pump(index, stream))

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
        except Exception as e:  # the engine failed this request: report it, keep serving
            self._queue.put_nowait((index, e))

    async def events(self, keep_alive_s: float | None = None) -> AsyncIterator[tuple | None]:
        """(choice index, new text, new token ids, new logprobs) per engine output, in arrival
        order; None every keep_alive_s without one. Ends when every choice has finished."""
        unfinished = len(self.choices)
        try:
            while unfinished:
                try:
                    index, out = await asyncio.wait_for(self._queue.get(), keep_alive_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if isinstance(out, Exception):
                    raise APIError(500, f"the engine failed the request: {out}")
                choice = self.choices[index]
                self._record(choice, out)
                if choice.num_prompt_tokens == 0:
                    choice.num_prompt_tokens = out.num_prompt_tokens
                    choice.num_cached_tokens = out.num_cached_tokens
                    if index % self._n == 0:  # the prompt is cached now: start its siblings
                        for sibling in range(index + 1, index + self._n):
                            if self.aborted:  # shutting down: they never start
                                self.choices[sibling].finish_reason = "abort"
                                unfinished -= 1
                            else:
                                self._start(sibling)
                if out.finished:
                    unfinished -= 1
                    choice.finish_reason = out.finish_reason
                    self._record_finish(choice, out)
                yield index, out.text, out.token_ids, out.logprobs or []
        finally:
            self.close()

    def _record(self, choice: Choice, out: RequestOutput) -> None:
        now = time.perf_counter()
        choice.text.append(out.text)
        choice.token_ids.extend(out.token_ids)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        if not out.token_ids:
            return
        if choice.t_last is None:
            self._metrics.first_token(now - self.t_arrival)
            if self.t_first_token is None:
                self.t_first_token = now
            self._metrics.tokens(len(out.token_ids), None)
        else:
            self._metrics.tokens(len(out.token_ids), now - choice.t_last)
        choice.t_last = now

    def _record_finish(self, choice: Choice, out: RequestOutput) -> None:
        m = out.metrics
        queue_s = None if m is None else m.ttft_s - m.prefill_s
        e2e = time.perf_counter() - self.t_arrival
        self._metrics.finished(out.finish_reason, out.num_prompt_tokens, e2e, queue_s)

    def abort(self) -> None:
        """Stop every sequence at the engine's next step (their outputs end with 'abort')."""
        self.aborted = True
        for engine_id in self.engine_ids():
            self._engine.abort(engine_id)

    def close(self) -> None:
        """Abort what is still running (nobody will read it) and count it as aborted."""
        e2e = time.perf_counter() - self.t_arrival
        for index, task in self._tasks.items():
            if not task.done():
                task.cancel()  # the engine stream's own cleanup aborts the request
            choice = self.choices[index]
            if choice.finish_reason is None and not choice.closed:
                choice.closed = True
                self._metrics.finished("abort", choice.num_prompt_tokens, e2e, None)

    # -- totals for usage and the log line ---------------------------------------------------

    def usage(self) -> dict:
        # a prompt counts once however many choices share it (as OpenAI bills n)
        leads = self.choices[:: self._n]
        prompt = sum(c.num_prompt_tokens for c in leads)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in leads)},
        }
