"""Server-sent events, framed by hand: `data: {json}\\n\\n` per chunk, a comment line as the
keep-alive while a request waits, and `data: [DONE]` last (OpenAI's end of stream)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"
KEEP_ALIVE_S = 15.0  # proxies drop connections idle for 30-60 s
KEEP_ALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def frame(obj: dict) -> bytes:
    # compact JSON never contains a newline, so one `data:` line holds the whole event
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def wait_disconnect(receive) -> None:
    """Return when the client has gone (the request body must already be read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(coro, receive):
    """Run `coro` -> its result, or cancel it and return None if the client disconnects first."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    return work.result() if not work.cancelled() else None


class EventStream(Response):
    """A streamed `text/event-stream` response that stops (closing `events`, whose cleanup
    aborts the request) as soon as the client disconnects, not at the next write."""

    media_type = MEDIA_TYPE

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({**HEADERS, **(headers or {})})

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the connection broke mid-write
                pass
            finally:
                await self.events.aclose()

        try:
            await until_disconnect(stream(), receive)
        finally:
            if self.on_close is not None:
                self.on_close()
