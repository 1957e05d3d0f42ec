"""The fused int8 matmul for small n, shared by every quantized type: one row loop, one dot
product per block supplied by the unit.

Each prange item takes ROWS weight rows; every activation block is loaded once for all of them.
A row's partial sums stay in LANES float lanes (`simd`) until the row ends, and the bytes of
the rows PREFETCH_ROWS ahead are prefetched while these are computed: the hardware prefetcher
alone does not keep up with a walk of 4 rows at once.
"""

from functools import partial

import numpy as np
from numba import carray, njit, prange

from .act_quant import quantize_rows
from .floatbits import HALF_TABLE, opaque_one
from .simd import LANES, local_f32, prefetch

ROWS = 4  # written out in the loop below
ACC_SLOTS = ROWS * LANES
SMALL_BLOCK = 32  # the legacy types' block; K-quants' super-blocks are 256
PREFETCH_ROWS = 8  # two row groups ahead
LINE = 64  # bytes per prefetch: a cache line on every target we support


# flat: uint8[size] -> prefetch the lines of flat[start : start + nbytes], nbytes a constant of
# the type: a fixed sequence of hints 64 bytes apart plus the last byte (which covers every line
# the span touches), no loop and no clipping (a hint past the end never faults): a loop clipped
# to the array costs about as many instructions per block as a 4-bit block's dot product.
@njit(cache=True, inline="always")
def prefetch_span(flat, start, nbytes):
    for k in range((nbytes + LINE - 1) // LINE):
        prefetch(flat, start + k * LINE)
    prefetch(flat, start + nbytes - 1)


# -> float32[ROWS, LANES], a row group's accumulators. For 32-weight blocks on the stack, where
# LLVM keeps them in registers (see simd.local_f32): no store per block, and loads shared by the
# rows. A K-quant's 256-weight super-block needs those registers for its own unpacking, so its
# sums stay in memory.
@njit(cache=True, inline="always")
def accumulators(block):
    if block <= SMALL_BLOCK:
        return carray(local_f32(ACC_SLOTS), (ROWS, LANES))
    return np.empty((ROWS, LANES), np.float32)


# starts, ends: int64[parts] -> byte offset in flat of output row r, where part p holds rows
# ends[p - 1] .. ends[p] - 1 (rows of row_bytes bytes from flat[starts[p]])
@njit(cache=True, inline="always")
def row_offset(starts, ends, r, row_bytes):
    p = 0
    while r >= ends[p]:
        p += 1
    return starts[p] + (r - (ends[p - 1] if p > 0 else 0)) * row_bytes


# block_dot(acc f32[LANES], w u8[size], off, xr int8|int16[in], xsr int32[groups], b, dx, halves,
# one) -> float: adds block b of a weight row (its bytes at w[off]) times activation block b (xr,
# its sums xsr, its scale dx) into acc's lanes, and returns any part it computes as a scalar (a
# min or offset term); halves: floatbits.HALF_TABLE, for the block's float16 scales; one:
# floatbits.opaque_one, for the byte products (see simd._byte_pair_sums).
# flat: uint8 bytes holding the weight's parts (see row_offset; one weight: starts = [0],
# ends = [rows]), x: [n, in] float32 -> out: [n, sum of the parts' rows]: several weights of one
# type and input size (Q, K and V) in one launch. x is quantized to int8 blocks of `block`
# values with sums per `sum_group` (0: none), held as q_type (see act_quant); a weight row is
# in // block blocks of block_bytes. Inlined into each unit's own kernel (units.build).
@njit(cache=True, inline="always")
def block_matmul(
    block_dot, flat, starts, ends, halves, x, out, block, block_bytes, sum_group, q_type
):
    xq, xd, xs = quantize_rows(x, block, sum_group, q_type)
    one = opaque_one(halves)  # read once, outside the parallel loop
    n = xq.shape[0]
    nb = xd.shape[1]
    row_bytes = nb * block_bytes
    last = ends[ends.shape[0] - 1] - 1
    for c in prange((last + ROWS) // ROWS):
        r0 = ROWS * c
        # ragged edge: the last row again, so every row takes the same code path
        o0 = row_offset(starts, ends, r0, row_bytes)
        o1 = row_offset(starts, ends, min(r0 + 1, last), row_bytes)
        o2 = row_offset(starts, ends, min(r0 + 2, last), row_bytes)
        o3 = row_offset(starts, ends, min(r0 + 3, last), row_bytes)
        acc = accumulators(block)
        ahead = row_offset(starts, ends, min(r0 + PREFETCH_ROWS, last), row_bytes)
        for t in range(n):
            acc[:] = 0
            s0 = s1 = s2 = s3 = np.float32(0.0)
            xr, xsr = xq[t], xs[t]
            for b in range(nb):
                o = b * block_bytes
                if t == 0:
                    prefetch_span(flat, ahead + ROWS * o, ROWS * block_bytes)
                dx = xd[t, b]
                s0 += block_dot(acc[0], flat, o0 + o, xr, xsr, b, dx, halves, one)
                s1 += block_dot(acc[1], flat, o1 + o, xr, xsr, b, dx, halves, one)
                s2 += block_dot(acc[2], flat, o2 + o, xr, xsr, b, dx, halves, one)
                s3 += block_dot(acc[3], flat, o3 + o, xr, xsr, b, dx, halves, one)
            out[t, r0] = acc[0].sum() + s0
            if r0 + 1 <= last:
                out[t, r0 + 1] = acc[1].sum() + s1
            if r0 + 2 <= last:
                out[t, r0 + 2] = acc[2].sum() + s2
            if r0 + 3 <= last:
                out[t, r0 + 3] = acc[3].sum() + s3


def parts_of(raw):
    """A unit's `repack`: one weight as its bytes, flat, plus its part table (views, 16 bytes)."""
    return raw.reshape(-1), np.zeros(1, np.int64), np.array([raw.shape[0]], np.int64)


class PartsKernel:
    """A jitted kernel(flat, starts, ends, halves, x, out) on the (flat, starts, ends) of one or
    more weights' bytes (`parts_of`, `kernels.stack`), with floatbits.HALF_TABLE passed."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, packed, x, out):
        self.kernel(*packed, HALF_TABLE, x, out)

    def bind(self, packed):
        """-> f(x, out): the kernel with its weight arguments bound, no Python frame between."""
        return partial(self.kernel, *packed, HALF_TABLE)


class Fused(PartsKernel):
    """A unit's `matmul_small`, from its jitted wrapper of block_matmul."""
