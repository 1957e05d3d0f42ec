"""What the K-quant units (Q2_K ... Q6_K) share: 256-weight super-blocks, and the 6-bit
scale/min packing of Q4_K/Q5_K.

Scales stay in the file's bytes (no repack; extra_nbytes is block_matmul's 16-byte part table):
unpacking them costs a few integer operations per 256 weights, little next to the weights' own
unpacking.

Small-n matmul (`block_matmul`): x is quantized like llama.cpp's q8_K (int8 per 256-block with
one float scale, plus sums of every 16 int8 values, which fold the K-quant minimums and
offsets out of the dot products). Each unit's `block_dot` hands its super-block to the
intrinsic `kquant_dot.super_block_dot` builds from the type's layout.
"""

import numpy as np
from numba import njit

QK_K = 256
SUM_GROUP = 16  # activation sums per 16 values: the finest scale group of any K-quant
I32 = np.int32


# w: uint8 bytes, off: offset of a Q4_K/Q5_K block's 12 scale bytes, j: sub-block 0..7
# -> (scale, min), 6 bits each
@njit(cache=True, inline="always")
def scale_min_k4(w, off, j):
    if j < 4:
        return I32(w[off + j] & 63), I32(w[off + j + 4] & 63)
    sc = (w[off + j + 4] & 0x0F) | ((w[off + j - 4] >> 6) << 4)
    m = (w[off + j + 4] >> 4) | ((w[off + j] >> 6) << 4)
    return I32(sc), I32(m)
