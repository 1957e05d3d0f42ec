"""Q4_K: 256-weight super-blocks of 144 bytes, w = d*sc_j*q - dmin*m_j, q in 0..15.

Block bytes: d f16 [0:2], dmin f16 [2:4], 8 x (6-bit scale, 6-bit min) packed [4:16],
qs [16:144]: byte c*32+l holds sub-block 2c (low nibble) and 2c+1 (high nibble), element l.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .block_matmul import Fused, block_matmul, parts_of
from .floatbits import read_half
from .kquant_common import QK_K, SUM_GROUP, scale_min_k4
from .kquant_dot import GROUPS, Field, Layout, super_block_dot
from .matmul import RowTile, each_row, row_tile_matmul, with_halves
from .registry import QuantType, register
from .simd import dequant_u4_pair

TYPE_SIZE = 144
f32 = np.float32
SIXTEENTH = np.float32(1.0 / 16)  # a nibble's weight in the high half of its byte


# raw: [nb*144] uint8 (one row) -> out: [nb*256] float32, w = dl * q - ml per sub-block (as
# simd.dequant_u4_pair's dl * q + (-ml): the same bits); the high nibble taken in place against
# dl / 16, which is exact, so the products are bit-identical to dl * q.
@njit(cache=True)
def dequantize_row(raw, halves, out):
    for b in range(raw.shape[0] // TYPE_SIZE):
        i = b * TYPE_SIZE
        d = read_half(halves, raw, i)
        dmin = read_half(halves, raw, i + 2)
        for c in range(4):  # 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high
            sc0, m0 = scale_min_k4(raw, i + 4, 2 * c)
            sc1, m1 = scale_min_k4(raw, i + 4, 2 * c + 1)
            dl0, ml0 = d * np.float32(sc0), dmin * np.float32(m0)
            dl1, ml1 = d * np.float32(sc1) * SIXTEENTH, dmin * np.float32(m1)
            dequant_u4_pair(raw, i + 16 + 32 * c, dl0, -ml0, dl1, -ml1, out, b * QK_K + 64 * c)


# raw: [rows, nb*144] -> out: [rows, nb*256]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# flat, starts, ends: one or more weights' rows of nb*144 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, QK_K, TYPE_SIZE)


# sub-block j (32 weights): the low nibbles (j even) or high nibbles of qs bytes 32 * (j // 2)..
LAYOUT = Layout(
    fields=tuple((Field(16 + 32 * (j // 2), 4 * (j % 2), 4),) for j in range(GROUPS)),
    scales="packed6",
    d_at=0,
    dmin_at=2,
    scales_at=4,
)
dot_super_block = super_block_dot(LAYOUT)


# acc: [LANES], w: one row's bytes, off: super-block b's offset in w, xr: [in] int8, xsr: [in/16]
# sums of xr -> adds the super-block times activation block b into acc (see
# kquant_dot.super_block_dot, block_matmul)
@njit(cache=True, inline="always")
def block_dot(acc, w, off, xr, xsr, b, dx, halves, one):
    dot_super_block(acc, w, off, xr, b * QK_K, xsr, b * 16, dx, halves, one)
    return f32(0.0)


# flat, starts, ends: one or more weights' bytes (see block_matmul), x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True)
def matmul_fused(flat, starts, ends, halves, x, out):
    block_matmul(block_dot, flat, starts, ends, halves, x, out, QK_K, TYPE_SIZE, SUM_GROUP, np.int8)


register(
    QuantType(
        qtype=GGMLQuantizationType.Q4_K,
        block_size=QK_K,
        type_size=TYPE_SIZE,
        dequantize_rows=with_halves(dequantize_rows),
        matmul_small=Fused(matmul_fused),
        repack=parts_of,
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=12,
        matmul_rows=RowTile(matmul_rows),
    )
)
