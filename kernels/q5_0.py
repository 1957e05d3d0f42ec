"""Q5_0: blocks of 32 weights = float16 scale d, uint32 qh (5th bits), 16 bytes of low nibbles;
w = d * (q - 16). Element j: low nibble of byte j (j < 16) or high nibble of byte j - 16, plus
bit j of qh as bit 4.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import make_matmul_small
from .matmul import each_row, row_tile_matmul
from .q4_0 import U4, U15, half_at, nibble_pair_dot
from .registry import QuantType, register

BLOCK, TYPE_SIZE = 32, 22
i16, u16, f32 = np.int16, np.uint16, np.float32
S16 = np.int16(16)
mul, band = np.multiply, np.bitwise_and


# Bit j of the low (high) 16 bits of qh is the fifth bit of element j (j + 16): lane j of the
# loop tests it with this table (a vector load and an and; no per-lane variable shifts).
BITS = np.array([1 << j for j in range(16)], np.uint16)


# w3: [rows, nb, block bytes], o: offset of qh -> its low and high 16 bits (fifth bits)
@njit(cache=True, inline="always")
def fifth_bits(w3, r, b, o):
    lo = u16(w3[r, b, o]) | u16(w3[r, b, o + 1]) << u16(8)
    hi = u16(w3[r, b, o + 2]) | u16(w3[r, b, o + 3]) << u16(8)
    return lo, hi


# lo/hi: fifth bits of elements 0..15 / 16..31, bit: BITS[j], xl/xh: activations j, j + 16
# -> fifth bit of j * xl + fifth bit of j + 16 * xh in int16
@njit(cache=True, inline="always")
def bit_pair_dot(lo, hi, bit, xl, xh):
    return np.add(mul(i16(band(lo, bit) != 0), xl), mul(i16(band(hi, bit) != 0), xh))


# raw: [nb * 22] (one row) -> out: [nb * 32]
@njit(cache=True)
def dequantize_row(raw, out):
    nb = raw.shape[0] // TYPE_SIZE
    # one row as [1, nb, block bytes]: the block helpers shared with the fused kernel index (r, b)
    w3 = raw.reshape(1, nb, TYPE_SIZE)
    o3 = out.reshape(1, nb, BLOCK)
    half = o3.shape[2] // 2  # runtime count: a constant 16 gets fully unrolled, scalar
    r = 0
    for b in range(nb):
        d = half_at(w3, r, b, 0)
        lo, hi = fifth_bits(w3, r, b, 2)
        for j in range(half):
            v = w3[r, b, 6 + j]
            q = np.add(i16(band(v, U15)), mul(i16(band(lo, BITS[j]) != 0), S16))
            o3[r, b, j] = d * f32(np.subtract(q, S16))
            q = np.add(i16(np.right_shift(v, U4)), mul(i16(band(hi, BITS[j]) != 0), S16))
            o3[r, b, half + j] = d * f32(np.subtract(q, S16))


# raw: [rows, nb * 22] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb * 22], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# raw: [out, nb * 22], xq: [n, in] int8, xd/xs: [n, nb] -> out: [n, out]
# q - 16 = (low nibble - 8) + 16 * fifth bit - 8, so over a block
# sum((q - 16) * x) = s + 16 * h - 8 * xs, with s = sum((nibble - 8) * x) (|s| <= 32 * 8 * 127)
# and h = sum(fifth bit * x) (|h| <= 32 * 127): both stay in int16 lanes (see q4_0.py). Two
# weight rows share each activation load (four measured slower: they spill registers).
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
                lo0, hi0 = fifth_bits(w3, r0, b, 2)
                lo1, hi1 = fifth_bits(w3, r1, b, 2)
                s0 = s1 = h0 = h1 = i16(0)
                for j in range(half):
                    xl = i16(x3[t, b, j])
                    xh = i16(x3[t, b, half + j])
                    bit = BITS[j]
                    s0 = np.add(s0, nibble_pair_dot(w3[r0, b, 6 + j], xl, xh))
                    s1 = np.add(s1, nibble_pair_dot(w3[r1, b, 6 + j], xl, xh))
                    h0 = np.add(h0, bit_pair_dot(lo0, hi0, bit, xl, xh))
                    h1 = np.add(h1, bit_pair_dot(lo1, hi1, bit, xl, xh))
                dx = xd[t, b]
                sx = 8 * xs[t, b]
                a0 += half_at(w3, r0, b, 0) * dx * f32(s0 + 16 * h0 - sx)
                a1 += half_at(w3, r1, b, 0) * dx * f32(s1 + 16 * h1 - sx)
            out[t, r0] = a0
            if r0 + 1 <= last:
                out[t, r1] = a1


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q5_0,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=make_matmul_small(_matmul_q8act, BLOCK, BLOCK),
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=1,
        matmul_rows=matmul_rows,
    )
)
