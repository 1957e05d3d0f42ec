"""One long-lived thread for every model call the app makes (pull, load, warm-up, each reply).

Numba's OpenMP layer keeps a thread team per launching thread: a second one oversubscribes the
cores, so every kernel must be entered from this one thread (decode then runs ~2.7x faster).
The app does not use `AsyncEngine`, which also owns such a thread, because it loads in its
constructor with no progress to show, and one conversation has nothing to batch: the loading
screen reports the pull and load steps from here, and a reply reads its Sequence's live
counters (TTFT, cached tokens) that AsyncEngine's outputs do not carry.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class ComputeThread:
    """Runs submitted jobs one after another on a single daemon thread (a daemon, so quitting
    never waits for a pull or a reply; replies stop through their cancel flag)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="edgeinfer-compute", daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        """job must not raise: it reports its own failures (the loader and Reply.run do)."""
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get()()
