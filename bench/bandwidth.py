"""Memory read bandwidth, the ceiling of decode speed: `python bench/bandwidth.py [threads]`."""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np


@numba.njit(parallel=True, cache=True)
def _read_all(a):
    # a: [n] int64 -> sum; each thread streams its own contiguous share
    s = 0
    for i in numba.prange(a.shape[0]):
        s += a[i]
    return s


def read_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Bytes/s: best of `reps` parallel reads of a `mib` MiB array (far larger than any cache)."""
    numba.set_num_threads(threads)
    a = np.ones(mib << 17, dtype=np.int64)
    _read_all(a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        _read_all(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split(":")[0])
    ap.add_argument(
        "threads",
        nargs="?",
        type=int,
        default=numba.config.NUMBA_NUM_THREADS,
        help="threads reading (default: Numba's, the logical CPUs)",
    )
    t = ap.parse_args().threads
    if not 1 <= t <= numba.config.NUMBA_NUM_THREADS:
        ap.error(f"threads must be 1 to {numba.config.NUMBA_NUM_THREADS}")
    print(f"{read_bandwidth(t) / 1e9:.1f} GB/s read, {t} threads")


if __name__ == "__main__":
    main()
