"""Activation quantization to int8 blocks (llama.cpp's q8_0 / q8_K idea) for integer dot products.

Each block of `block` consecutive values of a row gets one float32 scale d = max|x| / 127 and
int8 values q = round(x / d), so x ~= d * q. Optional group sums (sum of q over `sum_group`
consecutive values) let kernels fold weight offsets/minimums out of the inner loop:
sum(d_w * q_w + m) * x = dx * (d_w * sum(q_w * q_x) + m * sum(q_x)).
Legacy types use block = 32, with sums per 32 for their minimums (Q4_1, Q5_1) or offsets (Q4_0,
Q5_0); K-quants use block = 256, with sums per 16 for their minimums or offsets (Q3_K, Q6_K).
The byte products (every type but Q8_0) take q as int8, the 16-bit ones as int16.
"""

import numpy as np
from numba import njit


# -> max |x[t, b0 : b0 + block]|, NaNs skipped. On the values' bits: a float compare in a
# reduction keeps LLVM from vectorizing it (its order could matter to a NaN), where |x| as bits
# orders as |x| does and an unsigned maximum vectorizes (a row took 3.6x as long to quantize).
@njit(cache=True, inline="always")
def _abs_max(bits, t, b0, block):
    m = np.uint32(0)
    for j in range(block):
        a = bits[t, b0 + j] & np.uint32(0x7FFFFFFF)
        m = max(m, a if a <= np.uint32(0x7F800000) else np.uint32(0))  # above infinity: NaN
    return np.uint32(m).view(np.float32)


# x: [n, k], bits: x viewed as uint32 -> block b of row t into q: [n, k], d: [n, k // block],
# sums: [n, k // sum_group]
@njit(cache=True, inline="always")
def _quantize_block(x, bits, block, sum_group, q, d, sums, t, b):
    b0 = b * block
    amax = _abs_max(bits, t, b0, block)
    scale = amax / np.float32(127.0)
    inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
    d[t, b] = scale
    for j in range(block):
        q[t, b0 + j] = np.int8(np.rint(x[t, b0 + j] * inv))
    if sum_group > 0:
        for g in range(b0 // sum_group, (b0 + block) // sum_group):
            s = 0
            for j in range(g * sum_group, (g + 1) * sum_group):
                s += q[t, j]
            sums[t, g] = s


# x: [n, k] -> q: [n, k] of q_type, d: [n, k // block], sums: [n, k // sum_group] ([n, 0] for
# sum_group = 0); k a multiple of block, block of sum_group. Serial, inside the matmul kernel (a
# few rows: cheaper than a parallel launch). q_type: np.int8 for byte dot products, np.int16
# for 16-bit ones (widened once here rather than once per weight row).
@njit(cache=True, inline="always")
def quantize_rows(x, block, sum_group, q_type):
    n, k = x.shape
    q = np.empty((n, k), q_type)
    d = np.empty((n, k // block), np.float32)
    sums = np.empty((n, k // sum_group if sum_group > 0 else 0), np.int32)
    bits = x.view(np.uint32)
    for t in range(n):
        for b in range(k // block):
            _quantize_block(x, bits, block, sum_group, q, d, sums, t, b)
    return q, d, sums
