"""Live numbers for the stats panel, computed on the UI thread from the reply's counters.

Nothing here runs in the generation thread: the UI's timer samples the reply's token count and
token timestamps, so the panel can refresh several times a second at no cost to decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from time import perf_counter

import psutil

from .session import ChatSession, Progress

RATE_WINDOW_S = 1.0  # "tok/s now" averages over about this much recent decoding
PROCESS_EVERY_S = 1.0  # RSS and CPU % come from /proc reads: once a second is plenty
HISTORY = 120  # sparkline samples kept (one per refresh while generating)


class RateMeter:
    """Decode tokens/s over the last RATE_WINDOW_S of token timestamps.

    Samples are (time of the newest token, tokens generated so far); the first token is the
    end of prefill, so rates never include prompt processing.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def reset(self) -> None:
        self._samples.clear()

    def add(self, t_last: float | None, generated: int) -> None:
        if t_last is None or (self._samples and self._samples[-1][1] == generated):
            return
        self._samples.append((t_last, generated))
        while len(self._samples) > 2 and t_last - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None


@dataclass(frozen=True)
class StatsView:
    """Everything the panel shows at one refresh."""

    generating: bool
    rate: float | None  # decode tok/s: now while generating, else the last reply's average
    history: tuple[float, ...]
    progress: Progress | None  # the reply in flight, else the last finished one
    context_used: int
    context_max: int
    kv_blocks: tuple[int, int, int] | None  # used, total, cached
    window_blocks: tuple[int, int, int] | None  # the same in a sliding-window model's own pool
    drafts: tuple[int, int, int] | None  # speculative decoding: drafts, proposed, accepted
    rss_bytes: int
    cpu_percent: float


class LiveStats:
    """Turns a session's state into a StatsView; owns the rate history and the psutil probe."""

    def __init__(self) -> None:
        self.meter = RateMeter()
        self.history: deque[float] = deque(maxlen=HISTORY)
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only starts the measurement
        self._rss, self._cpu, self._sampled = self._process.memory_info().rss, 0.0, perf_counter()
        self._reply = None

    def view(self, session: ChatSession) -> StatsView:
        reply = session.reply if session.busy else None
        if reply is not None:
            if reply is not self._reply:
                self._reply = reply
                self.meter.reset()
            progress = reply.progress()
            self.meter.add(progress.t_last, progress.generated)
            rate = self.meter.rate()
            if rate is not None:
                self.history.append(rate)
        else:
            progress = session.last
            rate = _mean_decode_rate(progress)
        used = progress.prompt_tokens + progress.generated if progress else 0
        self._sample_process()
        return StatsView(
            generating=reply is not None,
            rate=rate,
            history=tuple(self.history),
            progress=progress,
            context_used=used,
            context_max=session.info.max_context,
            kv_blocks=session.kv_blocks(),
            window_blocks=session.window_blocks(),
            drafts=session.drafts(),
            rss_bytes=self._rss,
            cpu_percent=self._cpu,
        )

    def _sample_process(self) -> None:
        now = perf_counter()
        if now - self._sampled >= PROCESS_EVERY_S:
            self._sampled = now
            self._rss = self._process.memory_info().rss
            self._cpu = self._process.cpu_percent(None)


def _mean_decode_rate(p: Progress | None) -> float | None:
    tpot = p.tpot_s if p else None
    return 1.0 / tpot if tpot else None
