"""y = x · Wᵀ for any GGML type: fused int8 kernels for the smallest n, row-tile kernels (built
here from the units' row dequantizers) for batched decode and for every row of the row-wise
path (the engine's steps), dequantized tiles + BLAS for large n."""

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from . import threads
from .block_matmul import Fused
from .floatbits import HALF_TABLE
from .weight import QuantWeight

# Rows of W dequantized per BLAS call in the large-n path: a float32 tile of about this many bytes
# stays in L2/L3 while BLAS streams x through it.
TILE_BYTES = 2 << 20


# The row-tile kernel's cache blocking, in bytes of float32: each prange item dequantizes as many
# rows of W as fill TILE_W_BYTES (a multiple of 4, 8 to 32 rows), and the activation rows pass
# over them TILE_X_BYTES at a time, so that the item's rows and the current activation rows both
# stay in L2 while every 4 rows meet every activation row. Streaming all of x past every 4 rows
# of a fixed 8-row tile ran 8-10 % slower at n = 512 (Q4_1 [3072, 576] and [576, 1536], in-process
# A/B, 2 threads); out = 576 still splits into 18 items.
TILE_W_BYTES = 128 << 10
TILE_X_BYTES = 128 << 10


@njit(cache=True, inline="always")
def _tile_rows(k):
    return max(8, min(32, 4 * (TILE_W_BYTES // (16 * k))))


@njit(cache=True, inline="always")
def _tile_tokens(k):
    return max(2, 2 * (TILE_X_BYTES // (8 * k)))


# dequantize_row: a unit's serial (raw u8[row_bytes], halves, out f32[in]) -> None, halves:
# floatbits.HALF_TABLE (the blocks' float16 scales read through it: one load instead of a dozen
# bit operations, each 32 weights for the legacy types); raw: [rows, row_bytes] -> out:
# [rows, in]. Inlined into each unit's own kernel: a jitted function passed as an argument
# would key Numba's disk cache on its address, missing on every start.
@njit(cache=True, inline="always")
def each_row(dequantize_row, raw, halves, out):
    for r in prange(raw.shape[0]):
        dequantize_row(raw[r], halves, out[r])


def with_halves(kernel: Callable) -> Callable:
    """kernel(raw, halves, *rest), a unit's jitted kernel built on its dequantize_row -> the
    unit-interface f(raw, *rest), with floatbits.HALF_TABLE passed (an argument, not a constant
    compiled into every kernel: see floatbits)."""

    def call(raw, *rest):
        kernel(raw, HALF_TABLE, *rest)

    return call


# x: [n, in], raw: [out, row_bytes] -> out: [n, out]. Each prange item dequantizes _tile_rows
# rows into a float buffer, so W is unpacked once for all n, then multiplies (_tile_products).
# Inlined like `each_row`.
@njit(cache=True, inline="always")
def row_tile_matmul(dequantize_row, raw, halves, x, out):
    rows = raw.shape[0]
    k = x.shape[1]
    tile = _tile_rows(k)
    for g in prange((rows + tile - 1) // tile):
        r0 = g * tile
        last = min(tile, rows - r0) - 1
        w = np.empty((tile, k), np.float32)
        for i in range(last + 1):
            dequantize_row(raw[r0 + i], halves, w[i])
        _tile_products(w, last, x, out, r0)


# w: [tile rows, in] (rows 0..last dequantized), x: [n, in] -> out[:, r0 : r0 + last + 1]. For
# each block of _tile_tokens activation rows, for each 4 rows of w (kept in L1 while those
# activation rows stream past: faster than the other order at in = 1536), 4 rows x 2 activation
# rows per pass over `in` with float accumulators (6 loads per 8 FMAs). Ragged edges repeat the
# last row (same arithmetic, same value stored twice): every output takes one code path, so its
# bits do not depend on n, `out`, the blocking or the threads.
# Compiled with fastmath, which lets LLVM vectorize the reductions, and on its own, not inlined
# into the units' kernels: next to the legacy types' straight-line block dequantization
# (simd.dequant_u4) the same loops ran 15-20 % slower at n >= 32 (in-process A/B, Q4_1
# [3072, 576], identical inner loop); apart, every unit times the same as inlined or better.
@njit(cache=True, fastmath=True)
def _tile_products(w, last, x, out, r0):
    n, k = x.shape
    block = _tile_tokens(k)
    for t0 in range(0, n, block):
        for i in range(0, last + 1, 4):
            i1, i2, i3 = min(i + 1, last), min(i + 2, last), min(i + 3, last)
            w0, w1, w2, w3 = w[i], w[i1], w[i2], w[i3]
            for t in range(t0, min(t0 + block, n), 2):
                t1 = min(t + 1, n - 1)
                x0, x1 = x[t], x[t1]
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
                for j in range(k):
                    u, v = x0[j], x1[j]
                    a0 += w0[j] * u
                    a1 += w1[j] * u
                    a2 += w2[j] * u
                    a3 += w3[j] * u
                    b0 += w0[j] * v
                    b1 += w1[j] * v
                    b2 += w2[j] * v
                    b3 += w3[j] * v
                out[t, r0 + i], out[t, r0 + i1] = a0, a1
                out[t, r0 + i2], out[t, r0 + i3] = a2, a3
                out[t1, r0 + i], out[t1, r0 + i1] = b0, b1
                out[t1, r0 + i2], out[t1, r0 + i3] = b2, b3


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
    # at least one tile per thread: run_split hands out whole tiles
    tile = max(16, min(-(-rows // threads.get_threads()), TILE_BYTES // (4 * cols)))
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


def matmul(x: np.ndarray, w: QuantWeight, row_wise: bool = False) -> np.ndarray:
    """x: float32[n, in], w: QuantWeight [out, in] -> float32[n, out].

    By default the path is chosen by n alone. row_wise: every row through a kernel that computes
    it on its own, so that its bits depend neither on the other rows nor on n or the threads:
    what a batching engine needs to give each sequence the numbers it would get alone. (BLAS
    rounds a row depending on its place in the call's blocking.)
    """
    x = _check_x(x, w)
    threads.apply()
    return _row_wise(x, w) if row_wise else _by_n(x, w)


def bind_stacked(parts: list[QuantWeight], packed: tuple) -> Callable[[np.ndarray], np.ndarray]:
    """packed: `weight.stack(parts)`, or a lone part's own `.packed` -> f(x): x: float32[n, in],
    n <= the parts' small_n_max -> float32[n, sum of the parts' outs], in one kernel launch.

    Everything about the weights is settled here, once: a decode step makes about four such
    calls per layer, and the Python around a small call costs a tenth of it.
    """
    first = parts[0]
    out_cols = sum(p.shape[0] for p in parts)
    kernel = first.unit.bind_small(packed)

    def call(x: np.ndarray) -> np.ndarray:
        x = _check_x(x, first)
        threads.apply()
        out = np.empty((x.shape[0], out_cols), np.float32)
        kernel(x, out)
        return out

    return call


def _by_n(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    # the fastest path for this n (measured per unit: small_n_max, rows_n_max)
    n = x.shape[0]
    out = np.empty((n, w.shape[0]), np.float32)
    if w.unit.matmul_small is not None and n <= w.unit.small_n_max:
        w.unit.matmul_small(w.packed, x, out)
    elif w.unit.matmul_rows is not None and n <= w.unit.rows_n_max:
        w.unit.matmul_rows(w.raw, x, out)
    else:
        matmul_tiled(x, w, out)
    return out


# A unit whose int8 fused kernel beats its row-tile kernel up to this many rows (small_n_max)
# takes the fused kernel for row-wise work at every n: that is Q8_0, the output head of many
# models, whose rows in a step are one per sequence. (A Q8_0 model's other weights take it for
# prompt rows too, where it is 1.2-1.6x slower than the row-tile kernel; ad-hoc.)
ROW_WISE_FUSED_MIN = 32


# Rows of x per row-tile call on the row-wise path: the kernel streams all of its x past every
# 4 rows of W, so x must stay in cache ([512, 11008] x from DRAM: 1.9x slower than in blocks of
# 48 rows); each call dequantizes W again, little beside the FMAs of this many rows.
ROW_WISE_X_BYTES = 2 << 20


def _row_wise(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    # One kernel at every n: a row's bits must not depend on how many rows share the call. Every
    # unit's row-tile kernel and the quantized units' fused kernels compute each row on its own
    # (F32's small kernel is BLAS, which does not), so x can also be cut into blocks.
    n = x.shape[0]
    out = np.empty((n, w.shape[0]), np.float32)
    unit = w.unit
    if isinstance(unit.matmul_small, Fused) and unit.small_n_max >= ROW_WISE_FUSED_MIN:
        unit.matmul_small(w.packed, x, out)
        return out
    step = max(2, ROW_WISE_X_BYTES // (4 * x.shape[1]))
    for i in range(0, n, step):
        unit.matmul_rows(w.raw, x[i : i + step], out[i : i + step])
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
