"""y = x · Wᵀ for any GGML type: fused int8 kernels for the smallest n, row-tile kernels (built
here from the units' row dequantizers) for batched decode and for every row of the row-wise
path (the engine's steps), dequantized tiles + BLAS for large n."""

from collections.abc import Callable
from itertools import groupby

import numpy as np
from numba import njit, prange

from . import threads
from .block_matmul import Fused, PartsKernel, row_offset
from .int8_gemm import ENABLED as INT8_ENABLED
from .simd import DOT_COLS, DOT_ROWS, LINE, dot_tile, prefetch
from .weight import QuantWeight, stack, stack_rows

# Rows of W dequantized per BLAS call in the large-n path: a float32 tile of about this many bytes
# stays in L2/L3 while BLAS streams x through it.
TILE_BYTES = 2 << 20


# The row-tile kernel's cache blocking, in bytes of float32: each prange item dequantizes as many
# rows of W as fill TILE_W_BYTES (2 to 6 groups of DOT_ROWS), and the activation rows pass over
# them TILE_X_BYTES at a time, so that the item's rows and the current activation rows both stay
# in L2 while every DOT_ROWS rows meet every activation row.
TILE_W_BYTES = 128 << 10
TILE_X_BYTES = 128 << 10
# Each row's bytes are hinted PREFETCH_ROWS_AHEAD rows before they are dequantized: in a whole
# model's step the weights stream from DRAM, faster than the hardware prefetcher alone fetches
# them. (A benchmark that multiplies one weight again and again keeps it in cache: no gain there.)
PREFETCH_ROWS_AHEAD = 8


@njit(cache=True, inline="always")
def _tile_rows(k):
    return DOT_ROWS * max(2, min(6, TILE_W_BYTES // (4 * DOT_ROWS * k)))


@njit(cache=True, inline="always")
def _tile_tokens(k):
    return max(DOT_COLS, DOT_COLS * (TILE_X_BYTES // (4 * DOT_COLS * k)))


# flat, starts, ends: one or more weights' bytes (block_matmul.row_offset: Q, K and V in one
# launch), x: [n, in] -> out: [n, sum of the parts' rows]; a row is in // block blocks of
# block_bytes, dequantized by dequantize_row (a unit's serial (raw u8[row_bytes], halves,
# out f32[in]) -> None; halves: floatbits.HALF_TABLE, for the blocks' float16 scales). Each
# prange item dequantizes _tile_rows rows into a float buffer, so W is unpacked once for all n,
# then multiplies (_tile_products); the rows PREFETCH_ROWS_AHEAD ahead are hinted meanwhile,
# line by line. Inlined into each unit's kernel (units.build).
@njit(cache=True, inline="always")
def row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, block, block_bytes):
    rows = ends[ends.shape[0] - 1]
    k = x.shape[1]
    row_bytes = k // block * block_bytes
    tile = _tile_rows(k)
    for g in prange((rows + tile - 1) // tile):
        r0 = g * tile
        last = min(tile, rows - r0) - 1
        w = np.empty((tile, k), np.float32)
        for i in range(last + 1):
            at = row_offset(starts, ends, r0 + i, row_bytes)
            ahead = row_offset(starts, ends, min(r0 + i + PREFETCH_ROWS_AHEAD, rows - 1), row_bytes)
            for line in range(0, row_bytes, LINE):
                prefetch(flat, ahead + line)
            dequantize_row(flat[at : at + row_bytes], halves, w[i])
        _tile_products(w, last, x, out, r0)


class RowTile(PartsKernel):
    """A unit's `matmul_rows`, from its jitted wrapper of row_tile_matmul (on a weight's
    `row_parts`, or on `weight.stack_rows`)."""


# w: [tile rows, in] (rows 0..last dequantized), x: [n, in] -> out[:, r0 : r0 + last + 1]. For
# each block of _tile_tokens activation rows, for each DOT_ROWS rows of w (kept in L1 while those
# activation rows stream past), simd.dot_tile against DOT_COLS activation rows at a time; ragged
# edges take smaller tiles. Each output is its own chain of the same arithmetic whatever tile
# computes it, so its bits depend neither on n, `out`, the blocking nor the threads, and no row
# or activation row is computed twice. Compiled on its own, not inlined into the units' kernels:
# next to the legacy types' straight-line block dequantization its loops compile to slower code.
@njit(cache=True)
def _tile_products(w, last, x, out, r0):
    n, k = x.shape
    block = _tile_tokens(k)
    wf, xf, outf = w.reshape(-1), x.reshape(-1), out.reshape(-1)
    step = out.shape[1]
    for t0 in range(0, n, block):
        t_end = min(t0 + block, n)
        for i in range(0, last + 1, DOT_ROWS):
            rows = min(DOT_ROWS, last + 1 - i)
            t = t0
            while t + DOT_COLS <= t_end:
                _rows_by(rows, DOT_COLS, wf, i, xf, t, k, outf, t * step + r0 + i, step)
                t += DOT_COLS
            # the last activation rows: in twos, then one (DOT_COLS is 2 or 4)
            while t + 2 <= t_end:
                _rows_by(rows, 2, wf, i, xf, t, k, outf, t * step + r0 + i, step)
                t += 2
            if t < t_end:
                _rows_by(rows, 1, wf, i, xf, t, k, outf, t * step + r0 + i, step)


# simd.dot_tile of rows (1 to DOT_ROWS) rows of wf from row i by cols (a literal) rows of xf
# from row t, both [*, k] flattened, into outf at `at`, rows apart by `step`. A ragged edge (the
# last rows of a weight) goes a row at a time: the same bits, and too rare to need its own tiles.
@njit(cache=True, inline="always")
def _rows_by(rows, cols, wf, i, xf, t, k, outf, at, step):
    if rows == DOT_ROWS:
        dot_tile(DOT_ROWS, cols, wf, i * k, xf, t * k, k, outf, at, step)
    else:
        for r in range(rows):
            dot_tile(1, cols, wf, (i + r) * k, xf, t * k, k, outf, at + r, step)


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
    if row_wise:
        return bind_row_wise([w])(x)
    x = _check_x(x, w)
    threads.apply()
    return _by_n(x, w)


def bind_stacked(parts: list[QuantWeight], packed: tuple) -> Callable[[np.ndarray], np.ndarray]:
    """packed: `weight.stack(parts)`, or a lone part's own `.packed` -> f(x): x: float32[n, in],
    n <= the parts' small_n_max -> float32[n, sum of the parts' outs], in one kernel launch.

    Everything about the weights is settled here, once: a decode step makes about four such
    calls per layer, and the Python around a small call costs a tenth of it.
    """
    return _bound(parts, parts[0].unit.bind_small(packed), step=None)


def bind_small(parts: list[QuantWeight]) -> tuple[Callable[[np.ndarray], np.ndarray], int] | None:
    """-> (f, n_max): f(x), x: float32[n <= n_max, in] -> float32[n, sum of the parts' outs]
    through the fused small-n kernels, one launch per run of consecutive parts that stack (Q and
    K of one type, then a V of another, as Q4_K_M files mix them); n_max: the smallest of the
    runs' small_n_max. None: a part without a fused kernel, or a run that does not stack.

    A mixed run must not fall back to the GEMMs above small_n_max: at one row they take 1.5-1.9x
    the fused kernel's time (K-quants, Zen 4)."""
    calls, n_max = [], None
    for run in _runs(parts):
        unit = run[0].unit
        packed = stack(run) if len(run) > 1 else run[0].packed
        if unit.matmul_small is None or packed is None:
            return None
        calls.append(bind_stacked(run, packed))
        n_max = unit.small_n_max if n_max is None else min(n_max, unit.small_n_max)
    return _side_by_side(calls), n_max


def _runs(parts: list[QuantWeight]) -> list[list[QuantWeight]]:
    # runs of consecutive parts of one type and input size: those one kernel launch may take
    return [list(run) for _, run in groupby(parts, key=lambda p: (id(p.unit), p.shape[1]))]


def _side_by_side(calls: list[Callable]) -> Callable[[np.ndarray], np.ndarray]:
    # calls' f(x) -> f(x) = their outputs' columns side by side
    if len(calls) == 1:
        return calls[0]
    return lambda x: np.concatenate([call(x) for call in calls], axis=1)


def _bound(parts: list[QuantWeight], kernel: Callable, step: int | None) -> Callable:
    # kernel(x, out) on x in blocks of `step` rows (None: whole), checked and threaded as
    # kernels.matmul would, into out: float32[n, sum of the parts' outs]
    first = parts[0]
    out_cols = sum(p.shape[0] for p in parts)

    def call(x: np.ndarray) -> np.ndarray:
        x = _check_x(x, first)
        threads.apply()
        out = np.empty((x.shape[0], out_cols), np.float32)
        if step is None or x.shape[0] <= step:
            kernel(x, out)
        else:
            for i in range(0, x.shape[0], step):
                kernel(x[i : i + step], out[i : i + step])
        return out

    return call


def _by_n(x: np.ndarray, w: QuantWeight) -> np.ndarray:
    # the fastest path for this n (per unit: small_n_max, rows_n_max, int8_rows)
    n = x.shape[0]
    out = np.empty((n, w.shape[0]), np.float32)
    if w.unit.matmul_small is not None and n <= w.unit.small_n_max:
        w.unit.matmul_small(w.packed, x, out)
    elif w.unit.matmul_rows is not None and n <= w.unit.rows_n_max:
        rows = w.unit.matmul_int8 if takes_int8_rows(w.unit) else w.unit.matmul_rows
        rows(w.row_parts, x, out)
    else:
        matmul_tiled(x, w, out)
    return out


def takes_int8_rows(unit) -> bool:
    """Whether calls of small_n_max < n <= rows_n_max rows take the unit's int8 GEMM rather than
    its row tiles: where it is faster there (`int8_rows`, the K-quants) and the target enables it.
    Its rows are rounded to int8 as the fused kernel's are below small_n_max."""
    return INT8_ENABLED and unit.int8_faster and unit.int8_rows and unit.matmul_int8 is not None


# A unit whose int8 fused kernel beats its row-tile kernel up to this many rows (small_n_max)
# takes the fused kernel for row-wise work at every n: that is Q8_0, the output head of many
# models, whose rows in a step are one per sequence. (A Q8_0 model's other weights take it for
# prompt rows too, where the row-tile kernel would be faster.)
ROW_WISE_FUSED_MIN = 32


# Rows of x per row-tile call on the row-wise path: the kernel streams all of its x past each
# tile of W's rows, so x must stay in cache; each call dequantizes W again, little beside the
# FMAs of this many rows.
ROW_WISE_X_BYTES = 2 << 20


def bind_row_wise(
    parts: list[QuantWeight], int8: bool = False, exact: bool = False
) -> Callable[[np.ndarray], np.ndarray]:
    """-> f(x): x: float32[n, in] -> float32[n, sum of the parts' outs], every row through
    `matmul`'s row-wise path, each run of consecutive parts of one type and input size in one
    buffer (Q, K and V are in a model file) in one kernel launch; others part by part.

    One kernel at every n: a row's bits must not depend on how many rows share the call. Every
    unit's row-tile kernel and the quantized units' fused kernels compute each row on its own
    (F32's small kernel is BLAS, which does not), so x can also be cut into blocks.
    int8: the int8-activation GEMM (`int8_gemm`, row-wise too: each row rounded on its own),
    where the compile target enables it and it beats the unit's float row tiles (`int8_faster`);
    elsewhere the float path. exact: float activations for every type (no fused int8 kernel).
    """
    runs = _runs(parts)
    if len(runs) > 1:  # Q and K of one type, then a V of another (Q4_K_M): a launch a run
        return _side_by_side([bind_row_wise(run, int8, exact) for run in runs])
    first = parts[0]
    stacked = stack_rows(parts) if len(parts) > 1 else first.row_parts
    if stacked is None:
        return _side_by_side([bind_row_wise([p], int8, exact) for p in parts])
    unit = first.unit
    if int8 and INT8_ENABLED and unit.int8_faster:
        return _bound(parts, unit.matmul_int8.bind(stacked), step=None)
    if (
        not exact
        and isinstance(unit.matmul_small, Fused)
        and unit.small_n_max >= ROW_WISE_FUSED_MIN
    ):
        # it quantizes x row by row and reads W once per row group: no blocks needed
        return _bound(parts, unit.matmul_small.bind(stacked), step=None)
    step = max(2, ROW_WISE_X_BYTES // (4 * first.shape[1]))
    return _bound(parts, unit.matmul_rows.bind(stacked), step)


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
