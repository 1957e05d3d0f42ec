"""Q5_K: 256-weight super-blocks of 176 bytes, w = d*sc_j*q - dmin*m_j, q in 0..31.

Block bytes: d f16 [0:2], dmin f16 [2:4], 8 x (6-bit scale, 6-bit min) packed [4:16],
qh [16:48]: bit j of byte l is the 5th bit of element l of sub-block j,
qs [48:176]: low 4 bits, laid out as in Q4_K.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import make_matmul_small
from .kquant_common import I32, QK_K, SUM_GROUP, f16_at, scale_min_k4
from .matmul import each_row, row_tile_matmul
from .registry import QuantType, register

TYPE_SIZE = 176


# raw: [nb*176] uint8 (one row) -> out: [nb*256] float32
@njit(cache=True)
def dequantize_row(raw, out):
    nb = raw.shape[0] // TYPE_SIZE
    for b in range(nb):
        blk = raw[b * TYPE_SIZE : (b + 1) * TYPE_SIZE]
        o = out[b * QK_K : (b + 1) * QK_K]
        d = f16_at(blk, 0)
        dmin = f16_at(blk, 2)
        for j in range(8):
            sc, m = scale_min_k4(blk, 4, j)
            dl = d * np.float32(sc)
            ml = dmin * np.float32(m)
            q0 = 48 + (j >> 1) * 32
            shift = 4 * (j & 1)
            for l in range(32):
                q = ((blk[q0 + l] >> shift) & 0x0F) | (((blk[16 + l] >> j) & 1) << 4)
                o[j * 32 + l] = dl * np.float32(q) - ml


# raw: [rows, nb*176] -> out: [rows, nb*256]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb*176], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# raw: [out, nb*176] uint8, xq: [n, in] int8, xd: [n, nb] f32, xs: [n, in/16] int32 -> y: [n, out]
@njit(parallel=True, cache=True)
def matmul_q8(raw, xq, xd, xs, y):
    nb = raw.shape[1] // TYPE_SIZE
    for r in prange(raw.shape[0]):
        w = raw[r]
        for i in range(xq.shape[0]):
            xqi = xq[i]
            xsi = xs[i]
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * TYPE_SIZE
                blk = w[o : o + TYPE_SIZE]
                xb = xqi[b * QK_K : (b + 1) * QK_K]
                xsb = xsi[b * 16 : (b + 1) * 16]
                isum = 0
                msum = 0
                for c in range(4):  # as Q4_K, plus bits 2c / 2c+1 of qh as the 5th bit
                    sc0, m0 = scale_min_k4(blk, 4, 2 * c)
                    sc1, m1 = scale_min_k4(blk, 4, 2 * c + 1)
                    q0 = 48 + 32 * c
                    x0 = 64 * c
                    mask = 1 << (2 * c)
                    s0 = I32(0)
                    s1 = I32(0)
                    # low 4 bits and 5th bit summed apart: simple masks keep the lanes 16 bits wide
                    for l in range(32):
                        v = blk[q0 + l]
                        hb = blk[16 + l]
                        x_0 = I32(xb[x0 + l])
                        x_1 = I32(xb[x0 + 32 + l])
                        s0 = I32(s0 + I32(v & 15) * x_0 + I32(hb & mask != 0) * 16 * x_0)
                        s1 = I32(s1 + I32(v >> 4) * x_1 + I32(hb & (mask << 1) != 0) * 16 * x_1)
                    isum += sc0 * s0 + sc1 * s1
                    g = x0 // 16
                    msum += m0 * (xsb[g] + xsb[g + 1]) + m1 * (xsb[g + 2] + xsb[g + 3])
                d = f16_at(blk, 0)
                dmin = f16_at(blk, 2)
                acc += xd[i, b] * (d * np.float32(isum) - dmin * np.float32(msum))
            y[i, r] = acc


register(
    QuantType(
        qtype=GGMLQuantizationType.Q5_K,
        block_size=QK_K,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=make_matmul_small(matmul_q8, QK_K, SUM_GROUP),
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=1,
        matmul_rows=matmul_rows,
    )
)
