"""Q6_K: 256-weight super-blocks of 210 bytes, w = d*sc_j*(q - 32), q in 0..63, sc_j int8.

Block bytes: ql [0:128], qh [128:192], scales int8 [192:208] (one per 16 weights), d f16 [208:210].
Element e = 128*h + 32*s + l (h half, s quarter, l 0..31): low 4 bits from
ql[64*h + 32*(s & 1) + l] (nibble s >> 1), high 2 bits from qh[32*h + l] >> 2*s.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import make_matmul_small
from .kquant_common import I32, QK_K, SUM_GROUP, f16_at
from .matmul import each_row, row_tile_matmul
from .registry import QuantType, register

TYPE_SIZE = 210


# b: a byte -> its value as int8 (-128..127)
@njit(cache=True, inline="always")
def i8(b):
    v = I32(b)
    return v - ((v & 0x80) << 1)


# raw: [nb*210] uint8 (one row) -> out: [nb*256] float32
# Flat indexing and int32 bytes, 32 elements of each of 4 groups per step (per-block views and
# 16-trip loops kept LLVM off its 8-lane loop: 1.7x slower).
@njit(cache=True)
def dequantize_row(raw, out):
    nb = raw.shape[0] // TYPE_SIZE
    n16 = out.shape[0] // nb // 16  # runtime count: a constant 16 gets unrolled, scalar
    for b in range(nb):
        i = b * TYPE_SIZE
        d = f16_at(raw, i + 208)
        for h in range(2):  # 128-element halves: 4 groups of 32, each in two scale groups of 16
            ql = i + 64 * h
            qh = i + 128 + 32 * h
            e = b * QK_K + 128 * h
            for half in range(2):
                sc = i + 192 + 8 * h + half
                d0 = d * np.float32(i8(raw[sc]))
                d1 = d * np.float32(i8(raw[sc + 2]))
                d2 = d * np.float32(i8(raw[sc + 4]))
                d3 = d * np.float32(i8(raw[sc + 6]))
                for l in range(n16 * half, n16 * (half + 1)):
                    lo = I32(raw[ql + l])
                    hi = I32(raw[ql + 32 + l])
                    c = I32(raw[qh + l])
                    out[e + l] = d0 * np.float32(((lo & 15) | ((c & 3) << 4)) - 32)
                    out[e + 32 + l] = d1 * np.float32(((hi & 15) | (((c >> 2) & 3) << 4)) - 32)
                    out[e + 64 + l] = d2 * np.float32(((lo >> 4) | (((c >> 4) & 3) << 4)) - 32)
                    out[e + 96 + l] = d3 * np.float32(((hi >> 4) | ((c >> 6) << 4)) - 32)


# raw: [rows, nb*210] -> out: [rows, nb*256]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb*210], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# raw: [out, nb*210] uint8, xq: [n, in] int8, xd: [n, nb] f32, xs: [n, in/16] int32 -> y: [n, out]
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
                bsum = np.float32(0.0)
                for h in range(2):  # 128-element halves, each in two 16-element rows of groups
                    for half in range(2):
                        a0 = 64 * h + 16 * half
                        c0 = 128 + 32 * h + 16 * half
                        x0 = 128 * h + 16 * half
                        s0 = I32(0)
                        s1 = I32(0)
                        s2 = I32(0)
                        s3 = I32(0)
                        # q = low 4 bits + 16 * high 2 bits, each summed on its own: the simple
                        # masks let LLVM keep the lanes 16 bits wide
                        for l in range(16):
                            lo = blk[a0 + l]
                            hi = blk[a0 + 32 + l]
                            c = blk[c0 + l]
                            x_0 = I32(xb[x0 + l])
                            x_1 = I32(xb[x0 + 32 + l])
                            x_2 = I32(xb[x0 + 64 + l])
                            x_3 = I32(xb[x0 + 96 + l])
                            s0 = I32(s0 + I32(lo & 15) * x_0 + I32(c & 3) * 16 * x_0)
                            s1 = I32(s1 + I32(hi & 15) * x_1 + I32((c >> 2) & 3) * 16 * x_1)
                            s2 = I32(s2 + I32(lo >> 4) * x_2 + I32((c >> 4) & 3) * 16 * x_2)
                            s3 = I32(s3 + I32(hi >> 4) * x_3 + I32(c >> 6) * 16 * x_3)
                        # q is stored +32: sum((q - 32) * x) = sum(q * x) - 32 * sum(x)
                        g = x0 // 16
                        sc = 192 + 8 * h + half
                        t = i8(blk[sc]) * (s0 - 32 * xsb[g])
                        t += i8(blk[sc + 2]) * (s1 - 32 * xsb[g + 2])
                        t += i8(blk[sc + 4]) * (s2 - 32 * xsb[g + 4])
                        t += i8(blk[sc + 6]) * (s3 - 32 * xsb[g + 6])
                        # a float (ordered) sum here keeps LLVM vectorizing the inner loop, not this
                        bsum += np.float32(t)
                acc += xd[i, b] * f16_at(blk, 208) * bsum
            y[i, r] = acc


register(
    QuantType(
        qtype=GGMLQuantizationType.Q6_K,
        block_size=QK_K,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=make_matmul_small(matmul_q8, QK_K, SUM_GROUP),
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=3,
        matmul_rows=matmul_rows,
    )
)
