"""F16: IEEE half weights. Converted tile by tile to float32 for BLAS (every n takes that path:
with no per-block scales there is nothing for a fused integer kernel to save)."""

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .floatbits import half_to_float
from .registry import QuantType, register


# raw: [rows, cols * 2] -> out: [rows, cols]
@njit(parallel=True, cache=True)
def dequantize_rows(raw, out):
    for r in prange(raw.shape[0]):
        for j in range(out.shape[1]):
            out[r, j] = half_to_float(np.uint32(raw[r, 2 * j]) | np.uint32(raw[r, 2 * j + 1]) << 8)


UNIT = register(
    QuantType(
        qtype=GGMLQuantizationType.F16,
        block_size=1,
        type_size=2,
        dequantize_rows=dequantize_rows,
        matmul_small=None,
    )
)
