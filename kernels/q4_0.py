"""Q4_0: blocks of 32 weights = float16 scale d + 16 bytes of 4-bit q; w = d * (q - 8).

Byte j of a block holds element j (low nibble) and element j + 16 (high nibble).
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import quantize_act
from .floatbits import half_to_float
from .kquant_common import f16_at
from .matmul import each_row, row_tile_matmul
from .registry import QuantType, register

BLOCK, TYPE_SIZE = 32, 18
i16, i32, u32, f32 = np.int16, np.int32, np.uint32, np.float32
SIXTEENTH = f32(1.0 / 16)  # a nibble's weight in the high half of its byte
U15, U4, I8 = np.uint8(15), np.uint8(4), np.int16(8)
add, sub, mul, band, shr = np.add, np.subtract, np.multiply, np.bitwise_and, np.right_shift


# w3: [rows, nb, block bytes], r, b, o -> the float16 at byte o of block b of row r, as float32
@njit(cache=True, inline="always")
def half_at(w3, r, b, o):
    return half_to_float(u32(w3[r, b, o]) | u32(w3[r, b, o + 1]) << u32(8))


# raw: [nb * 18] (one row) -> out: [nb * 32]
# Flat indexing (no per-block views) and one int32 byte per step: LLVM vectorizes the 16-byte loop
# 8 lanes wide. The high nibble is taken in place, (v & 0xF0) - 128 = 16 (q - 8), against d / 16:
# bit-identical to d * (q - 8) (both products round the same real number; d / 16 is exact for
# any float16 d), without the 64-bit shift-and-pack LLVM emits for Numba's `v >> 4`.
@njit(cache=True)
def dequantize_row(raw, out):
    nb = raw.shape[0] // TYPE_SIZE
    half = out.shape[0] // nb // 2  # runtime count: a constant 16 gets fully unrolled, scalar
    for b in range(nb):
        i = b * TYPE_SIZE
        o = b * BLOCK
        d = f16_at(raw, i)
        d16 = d * SIXTEENTH
        for j in range(half):
            v = i32(raw[i + 2 + j])
            out[o + j] = d * f32((v & 15) - 8)
            out[o + half + j] = d16 * f32((v & 240) - 128)


# raw: [rows, nb * 18] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb * 18], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# v: a quant byte (elements j and j + 16 as nibbles), xl, xh: their int8 activations as int16
# -> (q_j - 8) * xl + (q_j+16 - 8) * xh in int16
@njit(cache=True, inline="always")
def nibble_pair_dot(v, xl, xh):
    return add(mul(sub(i16(band(v, U15)), I8), xl), mul(sub(i16(shr(v, U4)), I8), xh))


# raw: [out, nb * 18], xq: [n, in] int8, xd: [n, nb] -> out: [n, out]
# Four weight rows share each activation load. Nibbles are taken as signed (q - 8), so a block's
# whole dot product fits int16 (|sum| <= 32 * 8 * 127) and the loop runs in 16 int16 lanes with
# no widening. The arithmetic goes through scalar ufuncs (np.add, np.multiply, ...), which keep
# Numba's narrow integer types: its operators promote to int64, leaving LLVM 4 lanes per vector.
@njit(parallel=True, cache=True, fastmath=True)
def _matmul_q8act(raw, xq, xd, out):
    rows = raw.shape[0]
    n, k = xq.shape
    nb = xd.shape[1]
    half = k // nb // 2  # runtime count: a constant 16 gets fully unrolled and stays scalar
    # per-block views: constant offsets inside a block let LLVM drop negative-index checks
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
                    v = w3[r0, b, 2 + j]
                    s0 = add(s0, nibble_pair_dot(v, xl, xh))
                    v = w3[r1, b, 2 + j]
                    s1 = add(s1, nibble_pair_dot(v, xl, xh))
                    v = w3[r2, b, 2 + j]
                    s2 = add(s2, nibble_pair_dot(v, xl, xh))
                    v = w3[r3, b, 2 + j]
                    s3 = add(s3, nibble_pair_dot(v, xl, xh))
                dx = xd[t, b]
                a0 += half_at(w3, r0, b, 0) * dx * f32(s0)
                a1 += half_at(w3, r1, b, 0) * dx * f32(s1)
                a2 += half_at(w3, r2, b, 0) * dx * f32(s2)
                a3 += half_at(w3, r3, b, 0) * dx * f32(s3)
            out[t, r0] = a0
            if r0 + 1 <= last:
                out[t, r1] = a1
            if r0 + 2 <= last:
                out[t, r2] = a2
            if r0 + 3 <= last:
                out[t, r3] = a3


def matmul_small(packed, x, out):
    # x: [n, in], packed: (raw [out, nb * 18],) -> out: [n, out]
    (raw,) = packed
    xq, xd, _ = quantize_act(x, BLOCK)
    _matmul_q8act(raw, xq, xd, out)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q4_0,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=matmul_small,
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=2,
        matmul_rows=matmul_rows,
    )
)
