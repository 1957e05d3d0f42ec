"""Q2_K: 256-weight super-blocks of 84 bytes, w = d*sc_j*q - dmin*m_j, q in 0..3.

Block bytes: scales [0:16] (low nibble: 4-bit scale, high nibble: 4-bit min, one per 16 weights),
qs [16:80], d f16 [80:82], dmin f16 [82:84]. Element e = 128*h + 32*s + l takes bits 2s..2s+1 of
qs[32*h + l].
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import make_matmul_small
from .kquant_common import I32, QK_K, SUM_GROUP, f16_at
from .matmul import each_row, row_tile_matmul
from .registry import QuantType, register

TYPE_SIZE = 84


# raw: [nb*84] uint8 (one row) -> out: [nb*256] float32
@njit(cache=True)
def dequantize_row(raw, out):
    nb = raw.shape[0] // TYPE_SIZE
    for b in range(nb):
        blk = raw[b * TYPE_SIZE : (b + 1) * TYPE_SIZE]
        o = out[b * QK_K : (b + 1) * QK_K]
        d = f16_at(blk, 80)
        dmin = f16_at(blk, 82)
        for j in range(16):  # 16-element sub-blocks
            dl = d * np.float32(blk[j] & 0x0F)
            ml = dmin * np.float32(blk[j] >> 4)
            q0 = 16 + 32 * (j >> 3) + 16 * (j & 1)
            shift = 2 * ((j >> 1) & 3)
            for l in range(16):
                o[16 * j + l] = dl * np.float32((blk[q0 + l] >> shift) & 3) - ml


# raw: [rows, nb*84] -> out: [rows, nb*256]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb*84], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# raw: [out, nb*84] uint8, xq: [n, in] int8, xd: [n, nb] f32, xs: [n, in/16] int32 -> y: [n, out]
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
                isum = 0
                msum = 0
                for h in range(2):  # 128-element halves, each in two 16-element rows of groups
                    for half in range(2):
                        q0 = o + 16 + 32 * h + 16 * half
                        x0 = b * QK_K + 128 * h + 16 * half
                        s0 = I32(0)
                        s1 = I32(0)
                        s2 = I32(0)
                        s3 = I32(0)
                        for l in range(16):
                            v = w[q0 + l]
                            s0 = I32(s0 + I32(v & 3) * I32(xqi[x0 + l]))
                            s1 = I32(s1 + I32((v >> 2) & 3) * I32(xqi[x0 + 32 + l]))
                            s2 = I32(s2 + I32((v >> 4) & 3) * I32(xqi[x0 + 64 + l]))
                            s3 = I32(s3 + I32(v >> 6) * I32(xqi[x0 + 96 + l]))
                        g = x0 // 16
                        sc = o + 8 * h + half
                        isum += (w[sc] & 15) * s0 + (w[sc + 2] & 15) * s1
                        isum += (w[sc + 4] & 15) * s2 + (w[sc + 6] & 15) * s3
                        msum += (w[sc] >> 4) * xsi[g] + (w[sc + 2] >> 4) * xsi[g + 2]
                        msum += (w[sc + 4] >> 4) * xsi[g + 4] + (w[sc + 6] >> 4) * xsi[g + 6]
                d = f16_at(w, o + 80)
                dmin = f16_at(w, o + 82)
                acc += xd[i, b] * (d * np.float32(isum) - dmin * np.float32(msum))
            y[i, r] = acc


register(
    QuantType(
        qtype=GGMLQuantizationType.Q2_K,
        block_size=QK_K,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=make_matmul_small(matmul_q8, QK_K, SUM_GROUP),
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=6,
        matmul_rows=matmul_rows,
    )
)
