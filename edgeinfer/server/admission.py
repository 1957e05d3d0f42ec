"""Admission control: a bound on the waiting queue (503) and per-key rate limits (429).

Both answer with `Retry-After` so that a client backs off instead of retrying at once, as
vLLM's `--max-num-queued-reqs` and Ollama's `OLLAMA_MAX_QUEUE` do for the queue.
"""

from __future__ import annotations

import re
import time

from edgeinfer.errors import EdgeInferError
from edgeinfer.server.errors import APIError

_RATE = re.compile(r"\s*(\d+)\s*(?:/\s*(s|sec|second|m|min|minute|h|hour))?\s*", re.IGNORECASE)
_PERIOD_S = {"s": 1, "m": 60, "h": 3600}


def parse_rate(text: str) -> tuple[float, int]:
    """'60/min', '5/s', '1000/h', '60' (per minute) -> (requests per second, burst): a
    period's worth may come at once."""
    m = _RATE.fullmatch(text)
    if not m or int(m[1]) < 1:
        raise EdgeInferError(f"--rate-limit: not a rate: {text!r} (examples: 60/min, 5/s)")
    return int(m[1]) / _PERIOD_S[(m[2] or "m")[0].lower()], int(m[1])


class RateLimiter:
    """A token bucket per key: `rate` requests a second on average, bursts of up to one
    period's worth (e.g. 60 at once for 60/min). Memory is bounded by dropping full buckets."""

    def __init__(self, per_s: float, burst: int):
        self.per_s = per_s
        self.burst = float(max(1, burst))
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str) -> None:
        now = time.monotonic()
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.per_s)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            raise APIError(
                429,
                "rate limit exceeded for this API key; retry later",
                code="rate_limit_exceeded",
                retry_after=(1 - tokens) / self.per_s,
            )
        self._buckets[key] = (tokens - 1, now)
        if len(self._buckets) > 10_000:  # a full bucket carries no state worth keeping
            full = [
                k for k, (t, a) in self._buckets.items() if t + (now - a) * self.per_s >= self.burst
            ]
            for k in full:
                del self._buckets[k]


def check_queue(waiting: int, max_queue: int | None) -> None:
    """Refuse a request while `waiting` sequences already fill the queue."""
    if max_queue is not None and waiting >= max_queue:
        raise APIError(
            503,
            f"the server is busy: {waiting} requests are waiting (--max-queue {max_queue});"
            " retry later",
            code="queue_full",
            retry_after=1.0,
        )
