"""The one thread knob, for Numba's parallel kernels and for the BLAS work done by kernels.

Default: physical cores (hyper-threads share one core's load/FMA units, so they add contention,
not bandwidth). Numba keeps its thread count per calling thread, so `apply()` sets it at each
kernel call from a thread that has not taken the knob's value yet; after that it is one
thread-local comparison (asking Numba each time would add up over a decode step's hundreds of
calls).

BLAS runs single-threaded and `run_split` parallelises BLAS-backed work over row ranges in a
small thread pool instead: OpenBLAS's own threads spin-wait, and next to Numba's pool on a busy
machine they can take hundreds of times as long as one thread.
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import psutil
from threadpoolctl import threadpool_limits

# After a parallel kernel, GNU OpenMP's workers (Numba's "omp" layer) spin for GOMP_SPINCOUNT
# iterations before they sleep; by default long enough to hold a core through run_split's BLAS
# work, whose second thread then shares that core. 100000 still covers the gaps between a decode
# step's kernels. libgomp reads it once, when it is loaded: this must run before the first
# parallel kernel (or any other library using libgomp, such as llama.cpp's) in the process, and
# a value the user set wins. Child processes inherit it: INHERITED_SPINCOUNT (None: unset) lets
# a benchmark start llama.cpp as it would run.
INHERITED_SPINCOUNT = os.environ.get("GOMP_SPINCOUNT")
os.environ.setdefault("GOMP_SPINCOUNT", "100000")

_threads: int | None = None
_applied = threading.local()  # .count: the knob's value this thread last gave Numba
_pool: ThreadPoolExecutor | None = None


def _default() -> int:
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def get_threads() -> int:
    return _threads if _threads is not None else min(_default(), numba.config.NUMBA_NUM_THREADS)


def set_threads(n: int | None) -> int:
    """Use n threads for every kernel (None: physical cores). Returns the count in effect.

    Numba cannot start more threads than NUMBA_NUM_THREADS (default: logical CPUs), so n is
    clamped to that.
    """
    global _threads, _pool
    if n is not None and n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _threads = min(n if n is not None else _default(), numba.config.NUMBA_NUM_THREADS)
    threadpool_limits(limits=1, user_api="blas")  # process-wide; see the module docstring
    if _pool is not None:
        _pool.shutdown()
        _pool = None
    apply()
    return _threads


def apply() -> int:
    """Make the calling thread's Numba thread count match the knob; returns it."""
    if _threads is None:
        return set_threads(None)
    if getattr(_applied, "count", None) != _threads:
        numba.set_num_threads(_threads)
        _applied.count = _threads
    return _threads


def _serial(fn, lo, hi):
    numba.set_num_threads(1)  # this worker is one of the knob's threads already
    fn(lo, hi)


def _concurrent_numba_ok() -> bool:
    # Numba's fallback "workqueue" layer aborts when two threads launch parallel kernels at once
    # (e.g. macOS without libomp); before the first parallel kernel the layer is not chosen yet.
    try:
        return numba.threading_layer() != "workqueue"
    except ValueError:
        return False


def run_split(n_items: int, fn, min_items: int = 1) -> None:
    """Call fn(lo, hi) on contiguous parts of range(n_items), one part per thread (at least
    `min_items` items each), in parallel; Numba kernels inside fn run single-threaded.
    Where that is unsafe, one call fn(0, n_items) with Numba's own threads instead."""
    global _pool
    n = max(1, min(apply(), n_items // max(1, min_items)))
    if n == 1 or not _concurrent_numba_ok():
        fn(0, n_items)
        return
    bounds = [n_items * i // n for i in range(n + 1)]
    if _pool is None:
        _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="edgeinfer-kernel")
    futures = [_pool.submit(_serial, fn, bounds[i], bounds[i + 1]) for i in range(n - 1)]
    numba.set_num_threads(1)
    try:
        fn(bounds[n - 1], bounds[n])
    finally:
        numba.set_num_threads(_threads)
    for f in futures:
        f.result()
