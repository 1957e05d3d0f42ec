"""The fused int8 matmul for small n, shared by every quantized type: one row loop, one dot
product per block supplied by the unit.

Each prange item takes ROWS weight rows; every activation block is loaded once for all of them.
A row's partial sums stay in LANES float lanes (`simd`) until the row ends. The rows of item c
are c, c + G, c + 2G and c + 3G (G items): each of the four is one stream walking its quarter of
the weight row after row, which the hardware prefetcher follows, where four adjacent rows at once
made four short streams that it did not (a core read DRAM at 60 % of a single stream's rate).
Each stream's bytes PREFETCH_ROWS rows ahead are hinted too.
Several activation rows (a verify pass, a few decoding sequences) of a type whose unpacking
costs about as much as its products take the blocks outermost: each weight block is unpacked
once for up to SHARED_ROWS of them, in the same operations per row, so each row's bits are
those it gets alone.
"""

from functools import partial
from typing import NamedTuple

import numpy as np
from numba import carray, njit, prange

from .act_quant import quantize_rows
from .floatbits import HALF_TABLE, opaque_one
from .simd import LANES, LINE, VNNI_512, local_f32, prefetch

ROWS = 4  # written out in the loops below
ACC_SLOTS = ROWS * LANES
SMALL_BLOCK = 32  # the legacy types' block; K-quants' super-blocks are 256
PREFETCH_ROWS = 2  # rows ahead in each stream
SHARED_ROWS = 8  # activation rows, at most, that share one unpacking of each weight block
# from 3 rows: for 2, unpacking twice costs about what storing the rows' sums does
SHARED_FROM = 3
SHARED_SLOTS = SHARED_ROWS * ACC_SLOTS
SHARED_SUMS = SHARED_ROWS * ROWS


# flat: uint8[size] -> prefetch flat[start : start + nbytes], one span of a stream of adjacent
# spans (nbytes a constant of the type): hints 64 bytes apart from its start, which over the
# stream hint every line, no loop and no clipping (a hint past the end never faults): a loop
# clipped to the array costs about as many instructions per block as a 4-bit block's dot product.
@njit(cache=True, inline="always")
def prefetch_span(flat, start, nbytes):
    for k in range((nbytes + LINE - 1) // LINE):
        prefetch(flat, start + k * LINE)


# -> float32[ROWS, LANES], a row group's accumulators, on the stack, where LLVM keeps them in
# registers (see simd.local_f32): no store per block, and loads shared by the rows. Without
# AVX-512 VNNI (32 registers, a byte dot product an instruction) a K-quant's 256-weight
# super-block needs those registers for its own unpacking, so there its sums stay in memory.
@njit(cache=True, inline="always")
def accumulators(block):
    if block <= SMALL_BLOCK or VNNI_512:
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


# out[t, c + k * groups] = a row group's sums (RowGroup; acc: its lanes, s: its scalar parts),
# k = 0 .. 3, the rows up to last
@njit(cache=True, inline="always")
def _store_sums(out, t, group, acc, s):
    c, groups, last = group.c, group.groups, group.last
    out[t, c] = acc[0].sum() + s[0]
    if c + groups <= last:
        out[t, c + groups] = acc[1].sum() + s[1]
    if c + 2 * groups <= last:
        out[t, c + 2 * groups] = acc[2].sum() + s[2]
    if c + 3 * groups <= last:
        out[t, c + 3 * groups] = acc[3].sum() + s[3]


# -> x quantized (xq, xd, xs: see act_quant), floatbits.opaque_one, the last output row and the
# bytes of a weight row: what the kernels below read, made once, outside their parallel loop.
# (This and _row_group are called, not inlined by Numba: LLVM inlines them all the same, and
# Numba's inlining of a helper costs compile time in every type's kernel.)
@njit(cache=True)
def _operands(x, halves, ends, block, block_bytes, sum_group, q_type):
    xq, xd, xs = quantize_rows(x, block, sum_group, q_type)
    last = ends[ends.shape[0] - 1] - 1
    return xq, xd, xs, opaque_one(halves), last, xd.shape[1] * block_bytes


class RowGroup(NamedTuple):
    """Row group c of groups (last: the last output row; row_bytes: a weight row's bytes) and
    the byte offsets of its rows c, c + groups, c + 2 groups and c + 3 groups."""

    c: int
    groups: int
    last: int
    row_bytes: int
    o0: int
    o1: int
    o2: int
    o3: int


# -> RowGroup c of groups; past the ragged edge the last row again, so every row takes the same
# code path
@njit(cache=True)
def _row_group(starts, ends, c, groups, last, row_bytes):
    return RowGroup(
        c,
        groups,
        last,
        row_bytes,
        row_offset(starts, ends, c, row_bytes),
        row_offset(starts, ends, min(c + groups, last), row_bytes),
        row_offset(starts, ends, min(c + 2 * groups, last), row_bytes),
        row_offset(starts, ends, min(c + 3 * groups, last), row_bytes),
    )


# Hints the bytes PREFETCH_ROWS rows ahead of block o (a byte offset in the row) in each of a
# row group's streams (RowGroup); at a part's end they fall in the next part, or past the
# array, where a hint costs nothing.
@njit(cache=True, inline="always")
def _prefetch_streams(flat, group, o, block_bytes):
    ahead = PREFETCH_ROWS * group.row_bytes + o
    for at in (group.o0, group.o1, group.o2, group.o3):
        prefetch_span(flat, at + ahead, block_bytes)


# Every activation row against a row group (RowGroup), one row at a time, its sums in
# registers (accumulators); other arguments as in block_matmul.
@njit(cache=True, inline="always")
def _row_by_row(block_dot, flat, group, xq, xd, xs, halves, one, out, block, block_bytes):
    o0, o1, o2, o3 = group.o0, group.o1, group.o2, group.o3
    acc = accumulators(block)
    s = carray(local_f32(ROWS), (ROWS,))
    for t in range(xq.shape[0]):
        acc[:] = 0
        s[:] = 0
        xr, xsr = xq[t], xs[t]
        for b in range(xd.shape[1]):
            o = b * block_bytes
            if t == 0:
                _prefetch_streams(flat, group, o, block_bytes)
            block_dot(
                acc, s, flat, o0 + o, o1 + o, o2 + o, o3 + o, xr, xsr, b, xd[t, b], halves, one
            )
        _store_sums(out, t, group, acc, s)


# Activation rows t0 .. t1 - 1 (at most SHARED_ROWS) against a row group, blocks outermost: the
# loop over the rows reads each weight block's bytes and nothing of it changes there, so LLVM
# unpacks it once, before that loop (the rows' sums on the stack, indexed by row, where no store
# can alias the weights). Same operations per row as _row_by_row, in the same order.
@njit(cache=True, inline="always")
def _shared_blocks(block_dot, flat, group, xq, xd, xs, t0, t1, halves, one, out, block_bytes):
    o0, o1, o2, o3 = group.o0, group.o1, group.o2, group.o3
    accs = carray(local_f32(SHARED_SLOTS), (SHARED_ROWS, ROWS, LANES))
    sums = carray(local_f32(SHARED_SUMS), (SHARED_ROWS, ROWS))
    for t in range(t1 - t0):
        accs[t] = 0
        sums[t] = 0
    for b in range(xd.shape[1]):
        o = b * block_bytes
        if t0 == 0:
            _prefetch_streams(flat, group, o, block_bytes)
        for t in range(t1 - t0):
            row = np.uint64(t0 + t)  # unsigned: no negative-index fix-up for each block
            dx, xr, xsr = xd[row, b], xq[row], xs[row]
            block_dot(
                accs[t], sums[t], flat, o0 + o, o1 + o, o2 + o, o3 + o, xr, xsr, b, dx, halves, one
            )
    for t in range(t1 - t0):
        _store_sums(out, t0 + t, group, accs[t], sums[t])


# block_dot(acc f32[ROWS, LANES], sums f32[ROWS], w u8[size], o0, o1, o2, o3, xr int8|int16[in],
# xsr int32[groups], b, dx, halves, one): adds block b of ROWS weight rows (row r's bytes at
# w[o_r]) times activation block b (xr, its sums xsr, its scale dx) into acc[r]'s lanes, and any
# part it computes as a scalar (a min term) into sums[r]; halves: floatbits.HALF_TABLE, for the
# blocks' float16 scales; one: floatbits.opaque_one, for the byte products (see
# simd._byte_pair_sums).
# flat: uint8 bytes holding the weight's parts (see row_offset; one weight: starts = [0],
# ends = [rows]), x: [n, in] float32 -> out: [n, sum of the parts' rows]: several weights of one
# type and input size (Q, K and V) in one launch. x is quantized to int8 blocks of `block`
# values with sums per `sum_group` (0: none), held as q_type (see act_quant); a weight row is
# in // block blocks of block_bytes. Inlined into each unit's own kernel (units.build).
@njit(cache=True, inline="always")
def block_matmul(
    block_dot, flat, starts, ends, halves, x, out, block, block_bytes, sum_group, q_type
):
    xq, xd, xs, one, last, row_bytes = _operands(
        x, halves, ends, block, block_bytes, sum_group, q_type
    )
    groups = (last + ROWS) // ROWS
    for c in prange(groups):
        group = _row_group(starts, ends, c, groups, last, row_bytes)
        _row_by_row(block_dot, flat, group, xq, xd, xs, halves, one, out, block, block_bytes)


# block_matmul where, from SHARED_FROM rows of x on, they share each weight block's unpacking
# (_shared_blocks): for the types whose unpacking costs about as much as their products. (A
# function of its own, chosen per type by units.build: a type that does not share never compiles
# the shared loop.)
@njit(cache=True, inline="always")
def block_matmul_shared(
    block_dot, flat, starts, ends, halves, x, out, block, block_bytes, sum_group, q_type
):
    if x.shape[0] < SHARED_FROM:  # block_matmul's own parallel loop: the same code at 1 row
        block_matmul(
            block_dot, flat, starts, ends, halves, x, out, block, block_bytes, sum_group, q_type
        )
        return
    xq, xd, xs, one, last, row_bytes = _operands(
        x, halves, ends, block, block_bytes, sum_group, q_type
    )
    n, groups = xq.shape[0], (last + ROWS) // ROWS
    for c in prange(groups):
        group = _row_group(starts, ends, c, groups, last, row_bytes)
        for t0 in range(0, n, SHARED_ROWS):
            t1 = min(t0 + SHARED_ROWS, n)
            _shared_blocks(
                block_dot, flat, group, xq, xd, xs, t0, t1, halves, one, out, block_bytes
            )


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
    """A unit's `matmul_small`, from its jitted wrapper of block_matmul (or block_matmul_shared)."""
