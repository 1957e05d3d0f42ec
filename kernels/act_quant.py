"""Activation quantization to int8 blocks (llama.cpp's q8_0 / q8_K idea) for integer dot products.

Each block of `block` consecutive values of a row gets one float32 scale d = max|x| / 127 and
int8 values q = round(x / d), so x ~= d * q. Optional group sums (sum of q over `sum_group`
consecutive values) let kernels fold weight offsets/minimums out of the inner loop:
sum((w_q - 8) * x_q) = sum(w_q * x_q) - 8 * sum(x_q).
Legacy types use block = sum_group = 32; K-quants use block = 256 with sum_group = 16 or 32.
"""

import numpy as np
from numba import njit, prange


# x: [n, k] -> q: [n, k] int8, d: [n, k // block], sums: [n, k // sum_group] (or [n, 0])
@njit(parallel=True, cache=True)
def _quantize(x, block, sum_group, q, d, sums):
    n, k = x.shape
    nb = k // block
    for i in prange(n * nb):
        t = i // nb
        b0 = (i % nb) * block
        amax = np.float32(0.0)
        for j in range(block):
            a = abs(x[t, b0 + j])
            if a > amax:
                amax = a
        scale = amax / np.float32(127.0)
        inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
        d[t, i % nb] = scale
        for j in range(block):
            q[t, b0 + j] = np.int8(np.rint(x[t, b0 + j] * inv))
        if sum_group > 0:
            for g in range(b0 // sum_group, (b0 + block) // sum_group):
                s = 0
                for j in range(g * sum_group, (g + 1) * sum_group):
                    s += q[t, j]
                sums[t, g] = s


def quantize_act(x: np.ndarray, block: int, sum_group: int = 0):
    """x: float32[n, k] (C) -> q int8[n, k], d float32[n, k // block], sums int32[n, k // group]
    with group = sum_group.

    k must be a multiple of `block`, and `block` of `sum_group`; sum_group = 0 skips the sums
    (sums is then int32[n, 0]).
    """
    n, k = x.shape
    if k % block or (sum_group and block % sum_group):
        raise ValueError(f"row length {k} / block {block} / sum group {sum_group} do not divide")
    q = np.empty((n, k), np.int8)
    d = np.empty((n, k // block), np.float32)
    sums = np.empty((n, k // sum_group if sum_group else 0), np.int32)
    _quantize(x, block, sum_group, q, d, sums)
    return q, d, sums


def make_matmul_small(kernel, block: int, sum_group: int):
    """kernel(raw, xq, xd, xs, out) -> a unit's `matmul_small(packed, x, out)` that quantizes x
    to int8 blocks of `block` with sums per `sum_group` and runs the kernel on the raw weight."""

    def matmul_small(packed, x, out):
        # x: [n, in] float32, packed[0]: raw [out, row_bytes] -> out: [n, out]
        xq, xd, xs = quantize_act(x, block, sum_group)
        kernel(packed[0], xq, xd, xs, out)

    return matmul_small
