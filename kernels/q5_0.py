"""Q5_0: blocks of 32 weights = float16 scale d, uint32 qh (5th bits), 16 bytes of low nibbles;
w = d * (q - 16). Element j: low nibble of byte j (j < 16) or high nibble of byte j - 16, plus
bit j of qh as bit 4.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .block_matmul import Fused, block_matmul, parts_of
from .floatbits import read_half
from .matmul import RowTile, each_row, row_tile_matmul, with_halves
from .registry import QuantType, register
from .simd import dequant_u5, dot_u5

BLOCK, TYPE_SIZE = 32, 22
f32 = np.float32
SIXTEEN = np.int32(16)


# raw: [nb * 22] (one row) -> out: [nb * 32]
@njit(cache=True)
def dequantize_row(raw, halves, out):
    for b in range(raw.shape[0] // TYPE_SIZE):
        i = b * TYPE_SIZE
        dequant_u5(raw, i + 6, i + 2, SIXTEEN, read_half(halves, raw, i), None, out, b * BLOCK)


# raw: [rows, nb * 22] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# flat, starts, ends: one or more weights' rows of nb * 22 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE)


# acc: [LANES], w: one row's bytes, off: block b's offset in w, xr: [in] int8, xsr: [nb] sums
# of xr's blocks -> adds d * dx * (sum(q * xq) - 16 * sum(xq)) of block b into acc (the byte
# products take q unsigned; see block_matmul)
@njit(cache=True, inline="always")
def block_dot(acc, w, off, xr, xsr, b, dx, halves, one):
    d = read_half(halves, w, off) * dx
    dot_u5(acc, w, off + 6, off + 2, xr, b * BLOCK, np.int32(16 * xsr[b]), d, one)
    return f32(0.0)


# flat, starts, ends: one or more weights' bytes (see block_matmul), x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True)
def matmul_fused(flat, starts, ends, halves, x, out):
    block_matmul(block_dot, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE, BLOCK, np.int8)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q5_0,
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
