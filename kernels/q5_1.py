"""Q5_1: blocks of 32 weights = float16 scale d, float16 min m, uint32 qh (5th bits), 16 bytes of
low nibbles; w = d * q + m. Element j: low nibble of byte j (j < 16) or high nibble of byte
j - 16, plus bit j of qh as bit 4.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import make_matmul_small
from .floatbits import load_half, load_u32
from .matmul import each_row, row_tile_matmul
from .q4_0 import half_at, nibble_pair_dot
from .q5_0 import BITS, bit_pair_dot, fifth_bits
from .registry import QuantType, register

BLOCK, TYPE_SIZE = 32, 24
i16, u32, f32 = np.int16, np.uint32, np.float32


# raw: [nb * 24] (one row) -> out: [nb * 32]
@njit(cache=True)
def dequantize_row(raw, out):
    w = raw.reshape(1, raw.shape[0])  # the (row, offset) loaders shared with the fused kernel
    for b in range(raw.shape[0] // TYPE_SIZE):
        o = b * TYPE_SIZE
        d = load_half(w, 0, o)
        m = load_half(w, 0, o + 2)
        qh = load_u32(w, 0, o + 4)
        for j in range(16):
            v = u32(raw[o + 8 + j])
            lo = (v & u32(15)) | ((qh >> u32(j)) & u32(1)) << u32(4)
            hi = (v >> u32(4)) | ((qh >> u32(j + 16)) & u32(1)) << u32(4)
            out[b * 32 + j] = d * f32(lo) + m
            out[b * 32 + 16 + j] = d * f32(hi) + m


# raw: [rows, nb * 24] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb * 24], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# raw: [out, nb * 24], xq: [n, in] int8, xd/xs: [n, nb] -> out: [n, out]
# As Q5_0's kernel: q = (low nibble - 8) + 16 * fifth bit + 8, so over a block
# sum(w * x) = dx * (d * (s + 16 * h + 8 * xs) + m * xs), s and h in int16 lanes.
@njit(parallel=True, cache=True, fastmath=True)
def _matmul_q8act(raw, xq, xd, xs, out):
    rows = raw.shape[0]
    n, k = xq.shape
    nb = xd.shape[1]
    half = k // nb // 2  # runtime count: a constant 16 gets fully unrolled and stays scalar
    w3 = raw.reshape(rows, nb, TYPE_SIZE)
    x3 = xq.reshape(n, nb, BLOCK)
    last = rows - 1
    for c in prange((rows + 1) // 2):
        r0 = 2 * c
        r1 = min(r0 + 1, last)
        for t in range(n):
            a0 = a1 = f32(0.0)
            for b in range(nb):
                lo0, hi0 = fifth_bits(w3, r0, b, 4)
                lo1, hi1 = fifth_bits(w3, r1, b, 4)
                s0 = s1 = h0 = h1 = i16(0)
                for j in range(half):
                    xl = i16(x3[t, b, j])
                    xh = i16(x3[t, b, half + j])
                    bit = BITS[j]
                    s0 = np.add(s0, nibble_pair_dot(w3[r0, b, 8 + j], xl, xh))
                    s1 = np.add(s1, nibble_pair_dot(w3[r1, b, 8 + j], xl, xh))
                    h0 = np.add(h0, bit_pair_dot(lo0, hi0, bit, xl, xh))
                    h1 = np.add(h1, bit_pair_dot(lo1, hi1, bit, xl, xh))
                dx = xd[t, b]
                sx = xs[t, b]
                a0 += dx * (
                    half_at(w3, r0, b, 0) * f32(s0 + 16 * h0 + 8 * sx)
                    + half_at(w3, r0, b, 2) * f32(sx)
                )
                a1 += dx * (
                    half_at(w3, r1, b, 0) * f32(s1 + 16 * h1 + 8 * sx)
                    + half_at(w3, r1, b, 2) * f32(sx)
                )
            out[t, r0] = a0
            if r0 + 1 <= last:
                out[t, r1] = a1


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q5_1,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=make_matmul_small(_matmul_q8act, BLOCK, BLOCK),
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=1,
        matmul_rows=matmul_rows,
    )
)
