"""Q2_K: 256-weight super-blocks of 84 bytes, w = d*sc_j*q - dmin*m_j, q in 0..3.

Block bytes: scales [0:16] (low nibble: 4-bit scale, high nibble: 4-bit min, one per 16 weights),
qs [16:80], d f16 [80:82], dmin f16 [82:84]. Element e = 128*h + 32*s + l takes bits 2s..2s+1 of
qs[32*h + l].
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .block_matmul import Fused, block_matmul, parts_of
from .floatbits import read_half
from .kquant_common import QK_K, SUM_GROUP
from .kquant_dot import GROUPS, Field, Layout, super_block_dot
from .matmul import RowTile, each_row, row_tile_matmul, with_halves
from .registry import QuantType, register

TYPE_SIZE = 84
f32 = np.float32


# raw: [nb*84] uint8 (one row) -> out: [nb*256] float32
@njit(cache=True)
def dequantize_row(raw, halves, out):
    nb = raw.shape[0] // TYPE_SIZE
    for b in range(nb):
        blk = raw[b * TYPE_SIZE : (b + 1) * TYPE_SIZE]
        o = out[b * QK_K : (b + 1) * QK_K]
        d = read_half(halves, blk, 80)
        dmin = read_half(halves, blk, 82)
        for j in range(16):  # 16-element sub-blocks
            dl = d * np.float32(blk[j] & 0x0F)
            ml = dmin * np.float32(blk[j] >> 4)
            q0 = 16 + 32 * (j >> 3) + 16 * (j & 1)
            shift = 2 * ((j >> 1) & 3)
            for l in range(16):
                o[16 * j + l] = dl * np.float32((blk[q0 + l] >> shift) & 3) - ml


# raw: [rows, nb*84] -> out: [rows, nb*256]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# flat, starts, ends: one or more weights' rows of nb*84 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, QK_K, TYPE_SIZE)


# group g = 4h + s: elements 128h + 32s + l, bits 2s..2s+1 of qs byte 32h + l; its 16-weight
# halves scaled by the low nibbles of scale bytes 2g and 2g + 1 (minimums: the high ones)
LAYOUT = Layout(
    fields=tuple((Field(16 + 32 * (g // 4), 2 * (g % 4), 2),) for g in range(GROUPS)),
    scales="nibbles",
    d_at=80,
    dmin_at=82,
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
        qtype=GGMLQuantizationType.Q2_K,
        block_size=QK_K,
        type_size=TYPE_SIZE,
        dequantize_rows=with_halves(dequantize_rows),
        matmul_small=Fused(matmul_fused),
        repack=parts_of,
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=24,
        matmul_rows=RowTile(matmul_rows),
    )
)
