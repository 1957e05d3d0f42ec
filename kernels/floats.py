"""The float units: F32, F16 (IEEE half), BF16 (the top 16 bits of a float32).

None has a fused integer kernel: with no per-block scales there is nothing for one to save. F32
multiplies the file's bytes with BLAS at every n; F16 and BF16 are converted to float32 tile by
tile for BLAS. Every row-wise call takes the row-tile kernel (it computes each row on its own).
"""

import numpy as np
from numba import njit

from edgeinfer.gguf.constants import GGMLQuantizationType

from . import threads
from .floatbits import bf16_to_float, half_to_float
from .units import build

T = GGMLQuantizationType


# raw: [cols * 4] (one row) -> out: [cols]
@njit(cache=True)
def f32_row(raw, halves, out):
    out[:] = raw.view(np.float32)


def f32_rows(raw, out):
    # raw: [rows, cols * 4] -> out: [rows, cols]
    out[...] = raw.view(np.float32)


def f32_repack(raw):
    return (raw.view(np.float32),)


def f32_matmul(packed, x, out):
    # x: [n, in], packed: (w [out, in] float32,) -> out: [n, out]
    (w,) = packed

    def rows(lo: int, hi: int) -> None:
        out[:, lo:hi] = x @ w[lo:hi].T

    threads.run_split(w.shape[0], rows, min_items=64)


F32 = build(
    T.F32,
    f32_row,
    dequantize_rows=f32_rows,
    matmul_small=f32_matmul,
    repack=f32_repack,
    small_n_max=1 << 62,
)


# raw: [cols * 2] (one row) -> out: [cols]. Every element is a half: the bit conversion, which
# vectorizes, is faster than a load from the half table each.
@njit(cache=True)
def f16_row(raw, halves, out):
    for j in range(out.shape[0]):
        out[j] = half_to_float(np.uint32(raw[2 * j]) | np.uint32(raw[2 * j + 1]) << 8)


F16 = build(T.F16, f16_row)


# raw: [cols * 2] (one row) -> out: [cols]
@njit(cache=True)
def bf16_row(raw, halves, out):
    for j in range(out.shape[0]):
        out[j] = bf16_to_float(np.uint32(raw[2 * j]) | np.uint32(raw[2 * j + 1]) << 8)


BF16 = build(T.BF16, bf16_row)
