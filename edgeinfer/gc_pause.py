"""Start-up without the cyclic garbage collector's passes over start-up's own objects.

Importing the kernels (Numba's type registry) and loading a model (the vocabulary's tables)
make about 100k long-lived objects, and the collector walks all of them again each time they
grow by a quarter: 85-100 ms of SmolLM2's 0.6 s to its first token. Inside `start_up(step)` the
collector is off; at the end everything alive is frozen (gc.freeze: never walked again, still
freed by reference counts, as an LLM and its KV arrays are).

Only each step's first run freezes, and only when it completes: cyclic garbage alive at that
moment stays for good, a few hundred KB once per process (llvmlite IR where the kernels' CPU
probe ran), not again on later loads. A collector someone else turned off is left off.
"""

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_done: set[str] = set()


@contextmanager
def start_up(step: str) -> Iterator[None]:
    """Run the block with the collector off and freeze what it made, on step's first run."""
    if step in _done or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    except BaseException:
        gc.enable()
        raise
    _done.add(step)
    gc.freeze()
    gc.enable()
