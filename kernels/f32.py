"""F32: plain float32 weights; BLAS reads them straight from the file bytes."""

import numpy as np
from gguf import GGMLQuantizationType

from . import threads
from .registry import QuantType, register


def dequantize_rows(raw, out):
    # raw: [rows, cols * 4] -> out: [rows, cols]
    out[...] = raw.view(np.float32)


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
    )
)
