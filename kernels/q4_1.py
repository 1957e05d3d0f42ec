"""Q4_1: blocks of 32 weights = float16 scale d, float16 min m, 16 bytes of 4-bit q; w = d*q + m.

Byte j of a block holds element j (low nibble) and element j + 16 (high nibble).
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import make_matmul_small
from .kquant_common import f16_at
from .matmul import each_row, row_tile_matmul
from .q4_0 import SIXTEENTH, half_at, nibble_pair_dot
from .registry import QuantType, register

BLOCK, TYPE_SIZE = 32, 20
i16, i32, f32 = np.int16, np.int32, np.float32


# raw: [nb * 20] (one row) -> out: [nb * 32]
# Flat indexing (no per-block views) and one int32 byte per step: LLVM vectorizes the 16-byte loop
# 8 lanes wide. The high nibble is taken in place (v & 0xF0 = 16 q) against d / 16, which is
# bit-identical to d * q (both products round the same real number; d / 16 is exact for any
# float16 d) and saves the 64-bit shift-and-pack LLVM emits for Numba's `v >> 4`.
@njit(cache=True)
def dequantize_row(raw, out):
    nb = raw.shape[0] // TYPE_SIZE
    half = out.shape[0] // nb // 2  # runtime count: a constant 16 gets fully unrolled, scalar
    for b in range(nb):
        i = b * TYPE_SIZE
        o = b * BLOCK
        d = f16_at(raw, i)
        m = f16_at(raw, i + 2)
        d16 = d * SIXTEENTH
        for j in range(half):
            v = i32(raw[i + 4 + j])
            out[o + j] = d * f32(v & 15) + m
            out[o + half + j] = d16 * f32(v & 240) + m


# raw: [rows, nb * 20] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb * 20], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# raw: [out, nb * 20], xq: [n, in] int8, xd/xs: [n, nb] -> out: [n, out]
# As Q4_0's kernel (int16 lanes on q - 8, four rows per activation load). Over a block,
# sum(w * x) = dx * (d * sum(q * xq) + m * xs) with sum(q * xq) = sum((q - 8) * xq) + 8 * xs.
@njit(parallel=True, cache=True, fastmath=True)
def _matmul_q8act(raw, xq, xd, xs, out):
    rows = raw.shape[0]
    n, k = xq.shape
    nb = xd.shape[1]
    half = k // nb // 2  # runtime count: a constant 16 gets fully unrolled and stays scalar
    w3 = raw.reshape(rows, nb, TYPE_SIZE)
    x3 = xq.reshape(n, nb, BLOCK)
    last = rows - 1
    for c in prange((rows + 3) // 4):
        r0 = 4 * c
        r1, r2, r3 = min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last)
        for t in range(n):
            a0 = a1 = a2 = a3 = f32(0.0)
            for b in range(nb):
                s0 = s1 = s2 = s3 = i16(0)
                for j in range(half):
                    xl = i16(x3[t, b, j])
                    xh = i16(x3[t, b, half + j])
                    s0 = np.add(s0, nibble_pair_dot(w3[r0, b, 4 + j], xl, xh))
                    s1 = np.add(s1, nibble_pair_dot(w3[r1, b, 4 + j], xl, xh))
                    s2 = np.add(s2, nibble_pair_dot(w3[r2, b, 4 + j], xl, xh))
                    s3 = np.add(s3, nibble_pair_dot(w3[r3, b, 4 + j], xl, xh))
                dx = xd[t, b]
                sx = f32(xs[t, b])
                d = half_at(w3, r0, b, 0)
                a0 += dx * (d * f32(s0) + (f32(8.0) * d + half_at(w3, r0, b, 2)) * sx)
                d = half_at(w3, r1, b, 0)
                a1 += dx * (d * f32(s1) + (f32(8.0) * d + half_at(w3, r1, b, 2)) * sx)
                d = half_at(w3, r2, b, 0)
                a2 += dx * (d * f32(s2) + (f32(8.0) * d + half_at(w3, r2, b, 2)) * sx)
                d = half_at(w3, r3, b, 0)
                a3 += dx * (d * f32(s3) + (f32(8.0) * d + half_at(w3, r3, b, 2)) * sx)
            out[t, r0] = a0
            if r0 + 1 <= last:
                out[t, r1] = a1
            if r0 + 2 <= last:
                out[t, r2] = a2
            if r0 + 3 <= last:
                out[t, r3] = a3


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q4_1,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=make_matmul_small(_matmul_q8act, BLOCK, BLOCK),
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=2,
        matmul_rows=matmul_rows,
    )
)
