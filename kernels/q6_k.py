"""Q6_K: 256-weight super-blocks of 210 bytes, w = d*sc_j*(q - 32), q in 0..63, sc_j int8.

Block bytes: ql [0:128], qh [128:192], scales int8 [192:208] (one per 16 weights), d f16 [208:210].
Element e = 128*h + 32*s + l (h half, s quarter, l 0..31): low 4 bits from
ql[64*h + 32*(s & 1) + l] (nibble s >> 1), high 2 bits from qh[32*h + l] >> 2*s.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .block_matmul import Fused, block_matmul, parts_of
from .floatbits import read_half
from .kquant_common import I32, QK_K, SUM_GROUP
from .kquant_dot import GROUPS, Field, Layout, super_block_dot
from .matmul import RowTile, each_row, row_tile_matmul, with_halves
from .registry import QuantType, register
from .simd import dequant_q6_quarters

TYPE_SIZE = 210
f32 = np.float32


# b: a byte -> its value as int8 (-128..127)
@njit(cache=True, inline="always")
def i8(b):
    v = I32(b)
    return v - ((v & 0x80) << 1)


# raw: [nb*210] uint8 (one row) -> out: [nb*256] float32; each 16 positions of a half's four
# quarters in one simd.dequant_q6_quarters (d * (q - 32) as gguf computes it, bit for bit)
@njit(cache=True)
def dequantize_row(raw, halves, out):
    for b in range(raw.shape[0] // TYPE_SIZE):
        i = b * TYPE_SIZE
        d = read_half(halves, raw, i + 208)
        for h in range(2):  # 128-element halves: 4 groups of 32, each in two scale groups of 16
            for half in range(2):
                sc = i + 192 + 8 * h + half
                d0 = d * np.float32(i8(raw[sc]))
                d1 = d * np.float32(i8(raw[sc + 2]))
                d2 = d * np.float32(i8(raw[sc + 4]))
                d3 = d * np.float32(i8(raw[sc + 6]))
                lo, hi = i + 64 * h + 16 * half, i + 128 + 32 * h + 16 * half
                at = b * QK_K + 128 * h + 16 * half
                dequant_q6_quarters(raw, lo, hi, d0, d1, d2, d3, out, at)


# raw: [rows, nb*210] -> out: [rows, nb*256]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# flat, starts, ends: one or more weights' rows of nb*210 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, QK_K, TYPE_SIZE)


# group g = 4h + s: elements 128h + 32s + l (low 4 bits in ql, 2 high bits in qh; see above),
# its two 16-weight halves scaled by the int8 scales 2g and 2g + 1
LAYOUT = Layout(
    fields=tuple(
        (
            Field(64 * (g // 4) + 32 * (g % 2), 4 * ((g % 4) // 2), 4),
            Field(128 + 32 * (g // 4), 2 * (g % 4), 2, 4),
        )
        for g in range(GROUPS)
    ),
    scales="int8",
    d_at=208,
    scales_at=192,
    offset=32,
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
        qtype=GGMLQuantizationType.Q6_K,
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
