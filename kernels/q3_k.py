"""Q3_K: 256-weight super-blocks of 110 bytes, w = d*(sc_j - 32)*(q - 4*(1 - hbit)), q in 0..3.

Block bytes: hmask [0:32] (bit i of byte l: high bit of element 32*i + l, set = no -4 offset),
qs [32:96] (2-bit values laid out as in Q2_K), 16 x 6-bit scales packed [96:108], d f16 [108:110].
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

TYPE_SIZE = 110
f32 = np.float32


# w: bytes, o: offset of a block, j: 16-element sub-block 0..15 -> signed 6-bit scale (-32..31)
@njit(cache=True, inline="always")
def scale_q3k(w, o, j):
    lo = (w[o + 96 + (j & 7)] >> (4 * (j >> 3))) & 0x0F
    hi = (w[o + 104 + (j & 3)] >> (2 * (j >> 2))) & 3
    return np.int32(lo | (hi << 4)) - 32


# raw: [nb*110] uint8 (one row) -> out: [nb*256] float32
@njit(cache=True)
def dequantize_row(raw, halves, out):
    nb = raw.shape[0] // TYPE_SIZE
    for b in range(nb):
        blk = raw[b * TYPE_SIZE : (b + 1) * TYPE_SIZE]
        o = out[b * QK_K : (b + 1) * QK_K]
        d = read_half(halves, blk, 108)
        for j in range(16):
            dl = d * np.float32(scale_q3k(blk, 0, j))
            q0 = 32 + 32 * (j >> 3) + 16 * (j & 1)
            shift = 2 * ((j >> 1) & 3)
            hbit = j >> 1  # element 16*j + l sits in 32-element group j >> 1
            l0 = 16 * (j & 1)
            for l in range(16):
                q = np.int32((blk[q0 + l] >> shift) & 3)
                if not (blk[l0 + l] >> hbit) & 1:
                    q -= 4
                o[16 * j + l] = dl * np.float32(q)


# raw: [rows, nb*110] -> out: [rows, nb*256]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# flat, starts, ends: one or more weights' rows of nb*110 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, QK_K, TYPE_SIZE)


# group g = 4h + s: bits 2s..2s+1 of qs byte 32h + l, and hmask bit g of byte l as bit 2 (set:
# no -4), so q - 4 with q = low | hbit << 2; its 16-weight halves scaled by scales 2g, 2g + 1
LAYOUT = Layout(
    fields=tuple(
        (Field(32 + 32 * (g // 4), 2 * (g % 4), 2), Field(0, g, 1, 2)) for g in range(GROUPS)
    ),
    scales="signed6",
    d_at=108,
    scales_at=96,
    offset=4,
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
        qtype=GGMLQuantizationType.Q3_K,
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
