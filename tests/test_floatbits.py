"""floatbits: float16 -> float32 from the bits, identical on every machine (NaN payloads too)."""

import numpy as np
from numba import njit

from edgeinfer.kernels.floatbits import HALF_TABLE, half_to_float

BITS = np.arange(1 << 16, dtype=np.uint32)
NAN = (BITS & 0x7C00 == 0x7C00) & (BITS & 0x3FF != 0)


@njit(cache=True)
def _widen_all(bits, out):
    for i in range(bits.shape[0]):
        out[i] = half_to_float(bits[i])


def test_half_table_is_exact_for_every_number():
    # numpy's cast is exact for everything but NaN on every machine (and does not warn there).
    halves = BITS[~NAN].astype(np.uint16).view(np.float16)
    want = halves.astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(HALF_TABLE.view(np.uint32)[~NAN], want)


def test_half_table_keeps_nan_payloads():
    # IEEE widening of a NaN: same sign, all-ones exponent, the 10 payload bits on top of the
    # 23-bit mantissa, the rest zero; a signalling NaN (top payload bit clear) stays signalling.
    # aarch64's hardware conversion (numpy's astype there) sets the quiet bit instead.
    got = HALF_TABLE.view(np.uint32)[NAN]
    h = BITS[NAN]
    assert (got >> 31 == h >> 15).all()
    assert (got >> 23 & 0xFF == 0xFF).all()
    np.testing.assert_array_equal(got & 0x7FFFFF, (h & 0x3FF) << 13)
    signalling = h & 0x200 == 0
    assert signalling.sum() == 2 * 511
    assert (got[signalling] & 0x400000 == 0).all()


def test_half_to_float_matches_the_table():
    # Two ways to widen (a table built from integers, a rebias by multiplication in the kernels)
    # agree on every pattern, bit for bit.
    out = np.empty(BITS.size, np.float32)
    _widen_all(BITS, out)
    np.testing.assert_array_equal(out.view(np.uint32), HALF_TABLE.view(np.uint32))
