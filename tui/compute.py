"""One long-lived thread for every model call the app makes (load, warm-up, each reply).

Numba's OpenMP layer keeps a thread team per thread that launches parallel kernels; once a
second launching thread exists, the teams outnumber the cores and stop spinning between
kernels. Decoding SmolLM2 with 2 threads measured 46 tok/s when load and replies ran on one
thread and 17 tok/s when each reply had a thread of its own.
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
