"""Q5_0: blocks of 32 weights = float16 scale d, uint32 qh (5th bits), 16 bytes of low nibbles;
w = d * (q - 16). Element j: low nibble of byte j (j < 16) or high nibble of byte j - 16, plus
bit j of qh as bit 4.
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .block_matmul import Fused, block_matmul, parts_of
from .floatbits import read_half
from .matmul import each_row, row_tile_matmul, with_halves
from .registry import QuantType, register
from .simd import dot_u5

BLOCK, TYPE_SIZE = 32, 22
i16, u16, f32 = np.int16, np.uint16, np.float32
S16 = np.int16(16)
U15, U4 = np.uint8(15), np.uint8(4)
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


# raw: [nb * 22] (one row) -> out: [nb * 32]
@njit(cache=True)
def dequantize_row(raw, halves, out):
    nb = raw.shape[0] // TYPE_SIZE
    # one row as [1, nb, block bytes], indexed (r, b) as fifth_bits takes it
    w3 = raw.reshape(1, nb, TYPE_SIZE)
    o3 = out.reshape(1, nb, BLOCK)
    half = o3.shape[2] // 2  # runtime count: a constant 16 gets fully unrolled, scalar
    r = 0
    for b in range(nb):
        d = read_half(halves, raw, b * TYPE_SIZE)
        lo, hi = fifth_bits(w3, r, b, 2)
        for j in range(half):
            v = w3[r, b, 6 + j]
            q = np.add(i16(band(v, U15)), mul(i16(band(lo, BITS[j]) != 0), S16))
            o3[r, b, j] = d * f32(np.subtract(q, S16))
            q = np.add(i16(np.right_shift(v, U4)), mul(i16(band(hi, BITS[j]) != 0), S16))
            o3[r, b, half + j] = d * f32(np.subtract(q, S16))


# raw: [rows, nb * 22] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# raw: [out, nb * 22], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, halves, x, out):
    row_tile_matmul(dequantize_row, raw, halves, x, out)


# acc: [LANES], w: one row's bytes, off: block b's offset in w, xr: [in] int8, xsr: [nb] sums
# of xr's blocks -> adds d * dx * (sum(q * xq) - 16 * sum(xq)) of block b into acc (the byte
# products take q unsigned; see block_matmul)
@njit(cache=True, inline="always")
def block_dot(acc, w, off, xr, xsr, b, dx, halves, one):
    d = read_half(halves, w, off) * dx
    dot_u5(acc, w, off + 6, off + 2, xr, b * BLOCK, np.int32(16 * xsr[b]), d, one)
    return f32(0.0)


# flat, starts, ends: one or more weights' bytes (see block_matmul), x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True)
def matmul_fused(flat, starts, ends, halves, x, out):
    block_matmul(block_dot, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE, BLOCK, np.int8)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q5_0,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=with_halves(dequantize_rows),
        matmul_small=Fused(matmul_fused),
        repack=parts_of,
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=5,
        matmul_rows=with_halves(matmul_rows),
    )
)
