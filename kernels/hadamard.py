"""The orthonormal Walsh-Hadamard transform, in place, on runs of a power-of-two length.

H_n (Sylvester's order: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]) divided by sqrt(n) is
orthonormal and symmetric, so it is its own inverse and keeps dot products: (H q) . (H k) =
q . k. A quantized KV cache stores its head vectors rotated by it (kv_store.rotation), which
spreads outlying values over each run before they are rounded (as llama.cpp's attn_rot does).
"""

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def hadamard_(x, n):
    # x: float32[d], d a multiple of n (a power of two) -> each run x[a : a + n] times H_n/sqrt(n)
    scale = np.float32(1.0 / np.sqrt(n))
    for a in range(0, x.shape[0], n):
        step = 1
        while step < n:  # log2(n) butterfly stages
            for i in range(a, a + n, 2 * step):
                for j in range(i, i + step):
                    u, v = x[j], x[j + step]
                    x[j] = u + v
                    x[j + step] = u - v
            step *= 2
        for j in range(a, a + n):
            x[j] *= scale
