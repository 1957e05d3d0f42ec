"""Q3_K: 256-weight super-blocks of 110 bytes, w = d*(sc_j - 32)*(q - 4*(1 - hbit)), q in 0..3.

Block bytes: hmask [0:32] (bit i of byte l: high bit of element 32*i + l, set = no -4 offset),
qs [32:96] (2-bit values laid out as in Q2_K), 16 x 6-bit scales packed [96:108], d f16 [108:110].
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import make_matmul_small
from .kquant_common import I32, QK_K, SUM_GROUP, f16_at
from .matmul import each_row, row_tile_matmul
from .registry import QuantType, register

TYPE_SIZE = 110


# w: bytes, o: offset of a block, j: 16-element sub-block 0..15 -> signed 6-bit scale (-32..31)
@njit(cache=True, inline="always")
def scale_q3k(w, o, j):
    lo = (w[o + 96 + (j & 7)] >> (4 * (j >> 3))) & 0x0F
    hi = (w[o + 104 + (j & 3)] >> (2 * (j >> 2))) & 3
    return np.int32(lo | (hi << 4)) - 32


# raw: [nb*110] uint8 (one row) -> out: [nb*256] float32
@njit(cache=True)
def dequantize_row(raw, out):
    nb = raw.shape[0] // TYPE_SIZE
    for b in range(nb):
        blk = raw[b * TYPE_SIZE : (b + 1) * TYPE_SIZE]
        o = out[b * QK_K : (b + 1) * QK_K]
        d = f16_at(blk, 108)
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
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb*110], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# raw: [out, nb*110] uint8, xq: [n, in] int8, xd: [n, nb] f32, xs: [n, in/16] int32 -> y: [n, out]
@njit(parallel=True, cache=True)
def matmul_q8(raw, xq, xd, xs, y):
    nb = raw.shape[1] // TYPE_SIZE
    for r in prange(raw.shape[0]):
        w = raw[r]
        for i in range(xq.shape[0]):
            xqi = xq[i]
            acc = np.float32(0.0)
            for b in range(nb):
                o = b * TYPE_SIZE
                blk = w[o : o + TYPE_SIZE]
                xb = xqi[b * QK_K : (b + 1) * QK_K]
                bsum = np.float32(0.0)
                for h in range(2):  # 128-element halves, each in two 16-element rows of groups
                    m = 1 << (4 * h)  # hmask bit of group 4h + s is m << s
                    for half in range(2):
                        q0 = 32 + 32 * h + 16 * half
                        m0 = 16 * half
                        x0 = 128 * h + 16 * half
                        s0 = I32(0)
                        s1 = I32(0)
                        s2 = I32(0)
                        s3 = I32(0)
                        for l in range(16):
                            v = blk[q0 + l]
                            hm = blk[m0 + l]
                            # q = 2-bit value - 4 where the hmask bit is clear
                            q = I32(v & 3) - I32(hm & m == 0) * 4
                            s0 = I32(s0 + q * I32(xb[x0 + l]))
                            q = I32((v >> 2) & 3) - I32(hm & (m << 1) == 0) * 4
                            s1 = I32(s1 + q * I32(xb[x0 + 32 + l]))
                            q = I32((v >> 4) & 3) - I32(hm & (m << 2) == 0) * 4
                            s2 = I32(s2 + q * I32(xb[x0 + 64 + l]))
                            q = I32(v >> 6) - I32(hm & (m << 3) == 0) * 4
                            s3 = I32(s3 + q * I32(xb[x0 + 96 + l]))
                        j = 8 * h + half
                        t = scale_q3k(blk, 0, j) * s0 + scale_q3k(blk, 0, j + 2) * s1
                        t += scale_q3k(blk, 0, j + 4) * s2 + scale_q3k(blk, 0, j + 6) * s3
                        # a float (ordered) sum here keeps LLVM vectorizing the inner loop, not this
                        bsum += np.float32(t)
                acc += xd[i, b] * f16_at(blk, 108) * bsum
            y[i, r] = acc


register(
    QuantType(
        qtype=GGMLQuantizationType.Q3_K,
        block_size=QK_K,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=make_matmul_small(matmul_q8, QK_K, SUM_GROUP),
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=3,
        matmul_rows=matmul_rows,
    )
)
