"""Q5_K: 256-weight super-blocks of 176 bytes, w = d*sc_j*q - dmin*m_j, q in 0..31.

Block bytes: d f16 [0:2], dmin f16 [2:4], 8 x (6-bit scale, 6-bit min) packed [4:16],
qh [16:48]: bit j of byte l is the 5th bit of element l of sub-block j,
qs [48:176]: low 4 bits, laid out as in Q4_K.
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
from .simd import dequant_u5_sub

TYPE_SIZE = 176
f32 = np.float32


# raw: [nb*176] uint8 (one row) -> out: [nb*256] float32, w = dl * q - ml per sub-block (as
# simd.dequant_u5_sub's dl * q + (-ml): the same bits)
@njit(cache=True)
def dequantize_row(raw, halves, out):
    for b in range(raw.shape[0] // TYPE_SIZE):
        i = b * TYPE_SIZE
        d = read_half(halves, raw, i)
        dmin = read_half(halves, raw, i + 2)
        for j in range(8):
            sc, m = scale_min_k4(raw, i + 4, j)
            dl = d * np.float32(sc)
            ml = dmin * np.float32(m)
            q_at = i + 48 + (j >> 1) * 32
            dequant_u5_sub(raw, q_at, 4 * (j & 1), i + 16, j, dl, -ml, out, b * QK_K + j * 32)


# raw: [rows, nb*176] -> out: [rows, nb*256]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# flat, starts, ends: one or more weights' rows of nb*176 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, QK_K, TYPE_SIZE)


# sub-block j: low 4 bits as in Q4_K, bit j of qh byte l as bit 4 of element l
LAYOUT = Layout(
    fields=tuple(
        (Field(48 + 32 * (j // 2), 4 * (j % 2), 4), Field(16, j, 1, 4)) for j in range(GROUPS)
    ),
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
        qtype=GGMLQuantizationType.Q5_K,
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
