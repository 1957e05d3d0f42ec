"""F16: IEEE half weights. Converted tile by tile to float32 for BLAS (every n takes that path:
with no per-block scales there is nothing for a fused integer kernel to save)."""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .floatbits import half_to_float
from .matmul import RowTile, each_row, row_tile_matmul, with_halves
from .registry import QuantType, register


# raw: [cols * 2] (one row) -> out: [cols]
@njit(cache=True)
def dequantize_row(raw, halves, out):
    # every element is a half: the bit conversion, which vectorizes, beats a table load each
    for j in range(out.shape[0]):
        out[j] = half_to_float(np.uint32(raw[2 * j]) | np.uint32(raw[2 * j + 1]) << 8)


# raw: [rows, cols * 2] -> out: [rows, cols]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, halves, out):
    each_row(dequantize_row, raw, halves, out)


# flat, starts, ends: one or more weights' rows of cols * 2 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, 1, 2)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.F16,
        block_size=1,
        type_size=2,
        dequantize_rows=with_halves(dequantize_rows),
        matmul_small=None,
        matmul_rows=RowTile(matmul_rows),
    )
)
