"""F32: plain float32 weights; BLAS reads them straight from the file bytes (the row-tile
kernel, which computes each row on its own, serves kernels.matmul's row-wise path)."""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import threads
from .matmul import RowTile, row_tile_matmul
from .registry import QuantType, register


def dequantize_rows(raw, out):
    # raw: [rows, cols * 4] -> out: [rows, cols]
    out[...] = raw.view(np.float32)


# raw: [cols * 4] (one row) -> out: [cols]
@njit(cache=True)
def dequantize_row(raw, halves, out):
    out[:] = raw.view(np.float32)


# flat, starts, ends: one or more weights' rows of cols * 4 (matmul.row_tile_matmul),
# x: [n, in] -> out: [n, rows]
@njit(parallel=True, cache=True, fastmath=True)
def matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(dequantize_row, flat, starts, ends, halves, x, out, 1, 4)


def repack(raw):
    return (raw.view(np.float32),)


def matmul_small(packed, x, out):
    # x: [n, in], packed: (w [out, in] float32,) -> out: [n, out]; any n: nothing to dequantize
    (w,) = packed

    def rows(lo: int, hi: int) -> None:
        out[:, lo:hi] = x @ w[lo:hi].T

    threads.run_split(w.shape[0], rows, min_items=64)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.F32,
        block_size=1,
        type_size=4,
        dequantize_rows=dequantize_rows,
        matmul_small=matmul_small,
        repack=repack,
        small_n_max=1 << 62,
        matmul_rows=RowTile(matmul_rows),
    )
)
