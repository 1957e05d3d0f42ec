"""Q5_1: blocks of 32 weights = float16 scale d, float16 min m, uint32 qh (5th bits), 16 bytes of
low nibbles; w = d * q + m. Element j: low nibble of byte j (j < 16) or high nibble of byte
j - 16, plus bit j of qh as bit 4.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .block_matmul import Fused, block_matmul, parts_of
from .floatbits import read_half
from .matmul import RowTile, each_row, row_tile_matmul, with_halves
from .registry import QuantType, register
from .simd import dequant_u5, dot_u5

BLOCK, TYPE_SIZE = 32, 24
f32 = np.float32
ZERO = np.int32(0)  # no offset in the integers: the min is a float term


# raw: [nb * 24] (one row) -> out: [nb * 32]
@njit(cache=True)
def dequantize_row(raw, halves, out):
    for b in range(raw.shape[0] // TYPE_SIZE):
        i = b * TYPE_SIZE
        d, m = read_half(halves, raw, i), read_half(halves, raw, i + 2)
        dequant_u5(raw, i + 8, i + 4, ZERO, d, m, out, b * BLOCK)


# raw: [rows, nb * 24] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# flat, starts, ends: one or more weights' rows of nb * 24 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE)


# acc: [LANES], w: one row's bytes, off: block b's offset in w, xr: [in] int8, xsr: [nb] sums of
# xr's blocks -> adds d * dx * sum(q * xq) of block b into acc; returns the min's share,
# m * dx * sum(xq) (see block_matmul)
@njit(cache=True, inline="always")
def block_dot(acc, w, off, xr, xsr, b, dx, halves, one):
    dot_u5(acc, w, off + 8, off + 4, xr, b * BLOCK, ZERO, read_half(halves, w, off) * dx, one)
    return read_half(halves, w, off + 2) * dx * f32(xsr[b])


# flat, starts, ends: one or more weights' bytes (see block_matmul), x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True)
def matmul_fused(flat, starts, ends, halves, x, out):
    block_matmul(block_dot, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE, BLOCK, np.int8)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q5_1,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=with_halves(dequantize_rows),
        matmul_small=Fused(matmul_fused),
        repack=parts_of,
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=5,
        matmul_rows=RowTile(matmul_rows),
    )
)
