"""float16 / bfloat16 -> float32 from raw bits inside Numba kernels (Numba has no float16 math)."""

import numpy as np
from numba import njit

from .simd import F16_REBIAS, read_u16

_F32_MAGIC = np.float32(F16_REBIAS)  # rebias a float16 exponent (bias 15) to float32 (bias 127)


def _half_table() -> np.ndarray:
    """float16 bits -> float32 for all 65536 patterns, from the bits alone (integer arithmetic),
    so it is the same on every machine: numpy's float16 cast is not (aarch64 converts in
    hardware, which quiets signalling NaNs and warns; x86 keeps their payload)."""
    h = np.arange(1 << 16, dtype=np.uint32)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    normal = (exp + (127 - 15)) << 23 | mant << 13
    special = 0x7F800000 | mant << 13  # inf / NaN, payload and quiet bit kept
    # subnormal: mant * 2^-24; its top set bit p becomes float32's implicit one
    p = np.zeros_like(mant)
    for bit in range(1, 10):
        p[mant >> bit != 0] = bit
    subnormal = np.where(mant == 0, 0, (p + (127 - 24)) << 23 | (mant << (23 - p)) & 0x7FFFFF)
    bits = np.where(exp == 0x1F, special, np.where(exp == 0, subnormal, normal))
    return (sign | bits).astype(np.uint32).view(np.float32)


# The quantized units read their per-block float16 scales through it (fused kernels and row
# dequantizers alike; 256 KB), one load instead of a dozen bit operations. Passed to the kernels
# as an argument: a constant compiled into every kernel would make each compile and cache entry
# bigger.
HALF_TABLE = _half_table()


@njit(cache=True, inline="always")
def read_half(halves, w, i):
    """halves: HALF_TABLE, w: uint8[size]; the little-endian float16 at w[i:i+2] -> float32
    (unchecked offset)."""
    return halves[read_u16(w, i)]


ONE_BITS = 0x3C00  # float16 1.0


@njit(cache=True, inline="always")
def opaque_one(halves):
    """halves: HALF_TABLE -> 1 as uint8, read from the table, a runtime array, so that LLVM
    cannot see its value (see simd._byte_pair_sums)."""
    return np.uint8(halves[ONE_BITS])


@njit(cache=True, inline="always")
def half_to_float(h):
    """h: float16 bits (any unsigned int) -> float32, as HALF_TABLE[h] (NaN payloads kept)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    em = h & np.uint32(0x7FFF)
    if em >= np.uint32(0x7C00):
        # inf / NaN: keep the payload (numpy does on x86, not on aarch64)
        return np.uint32(
            sign | np.uint32(0x7F800000) | (em & np.uint32(0x3FF)) << np.uint32(13)
        ).view(np.float32)
    # Shifting exponent+mantissa into float32 position and scaling by 2^112 is exact for normal
    # and subnormal halves alike (a subnormal half lands on a float32 subnormal).
    f = np.float32(np.uint32(em << np.uint32(13)).view(np.float32) * _F32_MAGIC)
    return np.uint32(f.view(np.uint32) | sign).view(np.float32)


@njit(cache=True, inline="always")
def bf16_to_float(h):
    """h: bfloat16 bits -> float32 (bfloat16 is the top half of a float32)."""
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)
