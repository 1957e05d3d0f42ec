"""Q8_0: blocks of 32 weights = float16 scale d + 32 int8 q; w = d * q."""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .act_quant import quantize_act
from .floatbits import load_half
from .kquant_common import f16_at
from .matmul import each_row, row_tile_matmul
from .registry import QuantType, register

BLOCK, TYPE_SIZE = 32, 34
i32, f32 = np.int32, np.float32


# raw: [nb * 34] (one row) -> out: [nb * 32]
# Flat indexing: per-block views ([1, nb, 34] reshapes) kept LLVM off its 8-lane loop.
@njit(cache=True)
def dequantize_row(raw, out):
    nb = raw.shape[0] // TYPE_SIZE
    q = raw.view(np.int8)
    bs = out.shape[0] // nb  # runtime count: a constant 32 gets fully unrolled and stays scalar
    for b in range(nb):
        i = b * TYPE_SIZE
        o = b * BLOCK
        d = f16_at(raw, i)
        for j in range(bs):
            out[o + j] = f32(q[i + 2 + j]) * d


# raw: [rows, nb * 34] -> out: [rows, nb * 32]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    each_row(dequantize_row, raw, out)


# raw: [out, nb * 34], x: [n, in] -> out: [n, out]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(raw, x, out):
    row_tile_matmul(dequantize_row, raw, x, out)


# raw/qs: the same bytes as uint8 (scales) and int8 (quants), [out, nb * 34];
# xq: [n, in] int8, xd: [n, nb] -> out: [n, out]. Four weight rows share each activation load.
@njit(parallel=True, cache=True, fastmath=True)
def _matmul_q8act(raw, qs, xq, xd, out):
    rows = raw.shape[0]
    n, k = xq.shape
    nb = xd.shape[1]
    bs = k // nb  # runtime count: a constant 16/32 gets fully unrolled and stays scalar
    last = rows - 1
    for c in prange((rows + 3) // 4):
        r0 = 4 * c
        r1, r2, r3 = min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last)
        for t in range(n):
            a0 = a1 = a2 = a3 = f32(0.0)
            for b in range(nb):
                o = b * TYPE_SIZE + 2
                xo = b * BLOCK
                s0 = s1 = s2 = s3 = i32(0)
                for j in range(bs):
                    xv = xq[t, xo + j]
                    s0 = i32(s0 + i32(qs[r0, o + j] * xv))
                    s1 = i32(s1 + i32(qs[r1, o + j] * xv))
                    s2 = i32(s2 + i32(qs[r2, o + j] * xv))
                    s3 = i32(s3 + i32(qs[r3, o + j] * xv))
                dx = xd[t, b]
                a0 += load_half(raw, r0, o - 2) * dx * f32(s0)
                a1 += load_half(raw, r1, o - 2) * dx * f32(s1)
                a2 += load_half(raw, r2, o - 2) * dx * f32(s2)
                a3 += load_half(raw, r3, o - 2) * dx * f32(s3)
            out[t, r0] = a0
            if r0 + 1 <= last:
                out[t, r1] = a1
            if r0 + 2 <= last:
                out[t, r2] = a2
            if r0 + 3 <= last:
                out[t, r3] = a3


def repack(raw):
    # an int8 view of the same bytes (no copy): the quants are signed
    return raw, raw.view(np.int8)


def matmul_small(packed, x, out):
    # x: [n, in], packed: (raw u8, raw i8) [out, nb * 34] -> out: [n, out]
    raw, qs = packed
    xq, xd, _ = quantize_act(x, BLOCK)
    _matmul_q8act(raw, qs, xq, xd, out)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.Q8_0,
        block_size=BLOCK,
        type_size=TYPE_SIZE,
        dequantize_rows=dequantize_rows,
        matmul_small=matmul_small,
        # crossover with matmul_rows, measured (CPU time, 1 thread, [1024, 4096] weight)
        small_n_max=2,
        matmul_rows=matmul_rows,
        repack=repack,
    )
)
