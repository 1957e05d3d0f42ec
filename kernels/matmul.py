"""y = x · Wᵀ for any GGML type: fused kernels for small n, dequantized tiles + BLAS for large n."""

import numpy as np

from . import threads
from .weight import QuantWeight

# Rows of W dequantized per BLAS call in the large-n path: a float32 tile of about this many bytes
# stays in L2/L3 while BLAS streams x through it.
TILE_BYTES = 2 << 20


def _check_x(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"x of shape {x.shape} does not match weight {w.shape} (want [n, {w.shape[1]}])"
        )
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    return x


def matmul_tiled(x: np.ndarray, w: QuantWeight, out: np.ndarray) -> None:
    # x: [n, in], w: [out, in] -> out: [n, out]; W is float only one tile per thread at a time
    rows, cols = w.shape
    tile = max(16, min(rows, TILE_BYTES // (4 * cols)))
    dequantize_rows = w.unit.dequantize_rows

    def tiles(lo: int, hi: int) -> None:
        buf = np.empty((min(tile, hi - lo), cols), np.float32)
        for r0 in range(lo, hi, tile):
            r1 = min(hi, r0 + tile)
            wt = buf[: r1 - r0]
            dequantize_rows(w.raw[r0:r1], wt)
            # into a fresh contiguous block: numpy skips BLAS when `out` is a strided column slice
            out[:, r0:r1] = x @ wt.T

    threads.run_split(rows, tiles, min_items=tile)


def matmul(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    """x: float32[n, in], w: QuantWeight [out, in] -> float32[n, out]."""
    x = _check_x(x, w)
    threads.apply()
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    if w.unit.matmul_small is not None and x.shape[0] <= w.unit.small_n_max:
        w.unit.matmul_small(w.packed, x, out)
    else:
        matmul_tiled(x, w, out)
    return out


def embedding(w: QuantWeight, ids) -> np.ndarray:
    """w: [vocab, dim], ids: int[n] -> float32[n, dim] (dequantizes only the selected rows)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise IndexError(f"token id out of range [0, {w.shape[0]})")
    out = np.empty((ids.size, w.shape[1]), np.float32)
    rows = w.raw[ids]
    rows.flags.writeable = False
    threads.apply()
    w.unit.dequantize_rows(rows, out)
    return out
