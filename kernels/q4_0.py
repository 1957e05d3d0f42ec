"""Q4_0: blocks of 32 weights = float16 scale d + 16 bytes of 4-bit q; w = d * (q - 8).

Byte j of a block holds element j (low nibble) and element j + 16 (high nibble).
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .block_matmul import Fused, block_matmul, parts_of
from .floatbits import read_half
from .matmul import each_row, row_tile_matmul, with_halves
from .registry import QuantType, register
from .simd import dot_u4

BLOCK, TYPE_SIZE = 32, 18
i32, f32 = np.int32, np.float32
SIXTEENTH = f32(1.0 / 16)  # a nibble's weight in the high half of its byte


# raw: [nb * 18] (one row) -> out: [nb * 32]
# Flat indexing (no per-block views) and one int32 byte per step: LLVM vectorizes the 16-byte loop
# 8 lanes wide. The high nibble is taken in place, (v & 0xF0) - 128 = 16 (q - 8), against d / 16:
# bit-identical to d * (q - 8) (both products round the same real number; d / 16 is exact for
# any float16 d), without the 64-bit shift-and-pack LLVM emits for Numba's `v >> 4`.
@njit(cache=True)
def dequantize_row(raw, halves, out):
    nb = raw.shape[0] // TYPE_SIZE
    half = out.shape[0] // nb // 2  # runtime count: a constant 16 gets fully unrolled, scalar
    for b in range(nb):
        i = b * TYPE_SIZE
        o = b * BLOCK
        d = read_half(halves, raw, i)
        d16 = d * SIXTEENTH
        for j in range(half):
            v = i32(raw[i + 2 + j])
            out[o + j] = d * f32((v & 15) - 8)
            out[o + half + j] = d16 * f32((v & 240) - 128)


# raw: [rows, nb * 18] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# raw: [out, nb * 18], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, halves, x, out):
    row_tile_matmul(dequantize_row, raw, halves, x, out)


# acc: [LANES], w: one row's bytes, off: block b's offset in w, xr: [in] int8, xsr: [nb] sums
# of xr's blocks -> adds d * dx * (sum(q * xq) - 8 * sum(xq)) of block b into acc (the byte
# products take q unsigned; see block_matmul)
@njit(cache=True, inline="always")
def block_dot(acc, w, off, xr, xsr, b, dx, halves, one):
    dot_u4(acc, w, off + 2, xr, b * BLOCK, i32(8 * xsr[b]), read_half(halves, w, off) * dx, one)
    return f32(0.0)


# flat, starts, ends: one or more weights' bytes (see block_matmul), x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True)
def matmul_fused(flat, starts, ends, halves, x, out):
    block_matmul(block_dot, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE, BLOCK, np.int8)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q4_0,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=with_halves(dequantize_rows),
        matmul_small=Fused(matmul_fused),
        repack=parts_of,
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=7,
        matmul_rows=with_halves(matmul_rows),
    )
)
