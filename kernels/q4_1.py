"""Q4_1: blocks of 32 weights = float16 scale d, float16 min m, 16 bytes of 4-bit q; w = d*q + m.

Byte j of a block holds element j (low nibble) and element j + 16 (high nibble).
"""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import quantize_act
from .floatbits import load_half
from .registry import QuantType, register

BLOCK, TYPE_SIZE = 32, 20
i32, f32 = np.int32, np.float32


# raw: [rows, nb * 20] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    for r in prange(raw.shape[0]):
        for b in range(raw.shape[1] // TYPE_SIZE):
            o = b * TYPE_SIZE
            d = load_half(raw, r, o)
            m = load_half(raw, r, o + 2)
            for j in range(16):
                v = raw[r, o + 4 + j]
                out[r, b * 32 + j] = d * f32(v & 15) + m
                out[r, b * 32 + 16 + j] = d * f32(v >> 4) + m


# raw: [out, nb * 20], xq: [n, in] int8, xd/xs: [n, nb] -> out: [n, out]
# sum(w * x) over a block = d * dx * sum(q * xq) + m * dx * sum(xq): the min needs only the
# activation block sum xs. Four weight rows share each activation load.
@njit(parallel=True, cache=True, fastmath=True)
def _matmul_q8act(raw, xq, xd, xs, out):
    rows = raw.shape[0]
    n, k = xq.shape
    nb = xd.shape[1]
    half = k // nb // 2  # runtime count: a constant 16/32 gets fully unrolled and stays scalar
    last = rows - 1
    for c in prange((rows + 3) // 4):
        r0 = 4 * c
        r1, r2, r3 = min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last)
        for t in range(n):
            a0 = a1 = a2 = a3 = f32(0.0)
            for b in range(nb):
                o = b * TYPE_SIZE
                xo = b * BLOCK
                s0 = s1 = s2 = s3 = i32(0)
                for j in range(half):
                    xl = xq[t, xo + j]
                    xh = xq[t, xo + half + j]
                    v = raw[r0, o + 4 + j]
                    s0 = i32(s0 + i32((v & 15) * xl + (v >> 4) * xh))
                    v = raw[r1, o + 4 + j]
                    s1 = i32(s1 + i32((v & 15) * xl + (v >> 4) * xh))
                    v = raw[r2, o + 4 + j]
                    s2 = i32(s2 + i32((v & 15) * xl + (v >> 4) * xh))
                    v = raw[r3, o + 4 + j]
                    s3 = i32(s3 + i32((v & 15) * xl + (v >> 4) * xh))
                dx = xd[t, b]
                sx = dx * f32(xs[t, b])
                a0 += load_half(raw, r0, o) * dx * f32(s0) + load_half(raw, r0, o + 2) * sx
                a1 += load_half(raw, r1, o) * dx * f32(s1) + load_half(raw, r1, o + 2) * sx
                a2 += load_half(raw, r2, o) * dx * f32(s2) + load_half(raw, r2, o + 2) * sx
                a3 += load_half(raw, r3, o) * dx * f32(s3) + load_half(raw, r3, o + 2) * sx
            out[t, r0] = a0
            if r0 + 1 <= last:
                out[t, r1] = a1
            if r0 + 2 <= last:
                out[t, r2] = a2
            if r0 + 3 <= last:
                out[t, r3] = a3


def matmul_small(packed, x, out):
    # x: [n, in], packed: (raw [out, nb * 20],) -> out: [n, out]
    (raw,) = packed
    xq, xd, xs = quantize_act(x, BLOCK, BLOCK)
    _matmul_q8act(raw, xq, xd, xs, out)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q4_1,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=matmul_small,
        small_n_max=6,
    )
)
