"""How a paged KV cache stores its values, for kernels.attention: float16 bits (uint16; Numba has
no float16 arithmetic, so values are widened to float32 as they are read), float32, or quantized
as a pair (codes, scales) that holds each token's head vector in groups of GROUP values along the
head dimension, one float16 scale per group (ggml's block_q8_0 / block_q4_0, bit for bit, as
llama.cpp's quantized caches):
    K: codes [num_blocks, n_kv_heads, head_dim / per_byte, bs], scales [.., head_dim / GROUP, bs]
    V: codes [num_blocks, n_kv_heads, bs, v_head_dim / per_byte], scales [.., bs, v_dim / GROUP]
int8 codes are q8_0 (value = code * scale); uint8 ones hold two q4_0 codes a byte (value =
(code - 8) * scale; group values i and i + GROUP/2 in the low and high nibble of its byte i, as in
ggml). A token's groups depend on its own values alone, so a new token is quantized once, whole,
as it is written, and nothing already written changes. A quantized cache holds each head vector
rotated by an orthonormal Hadamard transform, as llama.cpp's quantized caches do, on runs of
its own (`rotation`).

Each function takes a K or a V cache of any of these kinds (typed per kind below); a runtime
`values` flag says which of K (keys as columns) and V (values as rows) it is where that matters.
"""

import numpy as np
from numba import njit
from numba.core import types
from numba.extending import overload

from .simd import F16_MASK, F16_REBIAS, F16_SHIFT, LINE, prefetch

# Values per float16 scale of a quantized cache: ggml's QK8_0 = QK4_0 (kv_cache.QUANT_GROUP).
GROUP = 32
_F16_SHIFT, _F16_MASK, _F16_REBIAS = np.int32(F16_SHIFT), np.int32(F16_MASK), np.float32(F16_REBIAS)


@njit(cache=True)
def float_to_half(x):
    """float32 -> float16 bits (uint16), round to nearest even, as numpy's astype(np.float16)."""
    u = np.float32(x).view(np.uint32)
    sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
    a = np.uint32(u & np.uint32(0x7FFFFFFF))
    if a >= np.uint32(0x7F800000):  # inf / NaN (keep NaN quiet)
        h = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a >= np.uint32(0x477FF000):  # rounds past 65504
        h = np.uint32(0x7C00)
    elif a >= np.uint32(0x38800000):  # normal half: rebias the exponent, round the mantissa
        r = np.uint32(a - np.uint32(0x38000000))
        odd = np.uint32((r >> np.uint32(13)) & np.uint32(1))
        h = np.uint32(np.uint32(r + np.uint32(0x0FFF) + odd) >> np.uint32(13))
    else:  # subnormal half or zero: scale by 2^24 (exact) and round half to even
        h = np.uint32(np.rint(a.view(np.float32) * np.float32(16777216.0)))
    return np.uint16(h | sign)


def _store(x, cache, blk, h, j, c):
    """x: float32 -> cache[blk, h, j, c] in the cache's storage dtype (typed per dtype below)."""


def _to_f32(x):
    """x: a value of the cache's storage dtype -> float32."""


@overload(_store)
def _store_impl(x, cache, blk, h, j, c):
    if cache.dtype == types.uint16:

        def impl(x, cache, blk, h, j, c):
            cache[blk, h, j, c] = float_to_half(x)

    else:

        def impl(x, cache, blk, h, j, c):
            cache[blk, h, j, c] = x

    return impl


@overload(_to_f32)
def _to_f32_impl(x):
    if x == types.uint16:

        def impl(x):
            # the branch-free widening described at simd.F16_SHIFT (so the widening loop vectorizes)
            bits = np.int32((np.int32(np.int16(x)) << _F16_SHIFT) & _F16_MASK)
            return np.float32(bits.view(np.float32) * _F16_REBIAS)

        return impl
    return lambda x: x


# x[a : a + GROUP] -> the float16 bits of its q8_0 scale d = max|x| / 127, and codes[i] = x[a + i]
# / d rounded half away from zero (x times 1/d in float32: ggml's quantize_row_q8_0_ref; the
# rounding written as gguf's np_roundf, exact in float32)
@njit(cache=True, inline="always")
def _q8_group(x, a, codes):
    amax = np.float32(0.0)
    for i in range(GROUP):
        amax = max(amax, abs(x[a + i]))
    d = np.float32(amax / np.float32(127.0))
    inv = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
    for i in range(GROUP):
        v = np.float32(x[a + i] * inv)
        m = abs(v)
        whole = np.float32(np.floor(m))
        r = np.int32(whole + np.float32(np.floor(np.float32(2.0) * (m - whole))))
        codes[i] = r if v >= 0 else -r
    return float_to_half(d)


# x[a : a + GROUP] -> the float16 bits of its q4_0 scale d = (the value of largest magnitude, the
# first of ties) / -8, and codes[i] = min(15, trunc(x[a + i] / d + 8.5)) (x times 1/d:
# ggml's quantize_row_q4_0_ref)
@njit(cache=True, inline="always")
def _q4_group(x, a, codes):
    mx = x[a]
    for i in range(1, GROUP):
        if abs(x[a + i]) > abs(mx):
            mx = x[a + i]
    d = np.float32(mx / np.float32(-8.0))
    inv = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
    for i in range(GROUP):
        codes[i] = min(15, np.int32(np.float32(x[a + i] * inv) + np.float32(8.5)))
    return float_to_half(d)


def put(x, cache, blk, h, off, values, codes):
    """x: float32[dim] -> the head-h vector of the token at offset off of block blk, in a K cache
    (values False: a column) or a V cache (a row); codes: int32[GROUP] scratch."""


@overload(put)
def _put_impl(x, cache, blk, h, off, values, codes):
    if not isinstance(cache, types.BaseTuple):

        def impl(x, cache, blk, h, off, values, codes):
            if values:
                for c in range(x.shape[0]):
                    _store(x[c], cache, blk, h, off, c)
            else:
                for c in range(x.shape[0]):
                    _store(x[c], cache, blk, h, c, off)

        return impl
    if cache[0].dtype == types.uint8:  # q4_0: two codes a byte

        def impl(x, cache, blk, h, off, values, codes):
            q, s = cache
            half = GROUP // 2
            for g in range(x.shape[0] // GROUP):
                d = _q4_group(x, g * GROUP, codes)
                for i in range(half):
                    byte = np.uint8(codes[i] | (codes[i + half] << 4))
                    if values:
                        q[blk, h, off, g * half + i] = byte
                    else:
                        q[blk, h, g * half + i, off] = byte
                if values:
                    s[blk, h, off, g] = d
                else:
                    s[blk, h, g, off] = d

        return impl

    def impl(x, cache, blk, h, off, values, codes):
        q, s = cache
        for g in range(x.shape[0] // GROUP):
            d = _q8_group(x, g * GROUP, codes)
            for i in range(GROUP):
                if values:
                    q[blk, h, off, g * GROUP + i] = np.int8(codes[i])
                else:
                    q[blk, h, g * GROUP + i, off] = np.int8(codes[i])
            if values:
                s[blk, h, off, g] = d
            else:
                s[blk, h, g, off] = d

    return impl


def rotation(cache, dim, values):
    """-> n: a quantized cache holds each head vector of dim values rotated by H_n/sqrt(n) on
    runs of n (hadamard_), which spreads a group's outlying values over it before they are
    rounded; 0 for a float cache. Keys turn within each group (n = GROUP), values over runs of
    64 where dim allows (else GROUP): on SmolLM2 and Gemma 3 that came closest to exact math
    with both q8_0 and q4_0, where llama.cpp's longer runs for keys (the longest power of two
    dividing dim) lose on Gemma 3's normed keys."""


@overload(rotation)
def _rotation_impl(cache, dim, values):
    if not isinstance(cache, types.BaseTuple):
        return lambda cache, dim, values: 0
    return lambda cache, dim, values: 2 * GROUP if values and dim % (2 * GROUP) == 0 else GROUP


def widen(cache, blk, h, dst):
    """A float cache's block blk, head h -> dst[:rows, :cols] as float32 (dst may be wider: its
    padding stays as it is); nothing for a quantized one (see codes_to_float). Indexed, not
    sliced: a view of the cache takes and drops a reference on it, two atomic updates of one
    counter that every thread shares, which at one view per block cost more than the copy."""


@overload(widen)
def _widen_impl(cache, blk, h, dst):
    if isinstance(cache, types.BaseTuple):
        return lambda cache, blk, h, dst: None

    def impl(cache, blk, h, dst):
        for j in range(cache.shape[2]):
            for c in range(cache.shape[3]):
                dst[j, c] = _to_f32(cache[blk, h, j, c])

    return impl


def codes_to_float(cache, flat, blk, h, dst, values):
    """A quantized cache's block blk, head h -> its codes as float32 values, unscaled (scales:
    see gather_scales), into dst (1-D, the block's [rows, cols] in order); nothing for a float
    cache. flat: the codes as one 1-D view (codes_flat), made once per call of the kernel: a
    loop over a block's whole run of codes vectorizes, where one over its rows of 16 keys or
    over a group of 32 values is unrolled into one value at a time. (Indices into flat are
    unsigned: a signed one gets Numba's negative-index wraparound, which keeps LLVM from
    vectorizing a loop whose start it cannot prove >= 0.)"""


@overload(codes_to_float)
def _codes_to_float_impl(cache, flat, blk, h, dst, values):
    if not isinstance(cache, types.BaseTuple):
        return lambda cache, flat, blk, h, dst, values: None
    if cache[0].dtype == types.int8:

        def impl(cache, flat, blk, h, dst, values):
            q = cache[0]
            n = q.shape[2] * q.shape[3]
            at = (blk * q.shape[1] + h) * n
            for e in range(n):
                dst[e] = np.float32(flat[np.uint64(at + e)])

        return impl
    half = GROUP // 2

    def impl(cache, flat, blk, h, dst, values):
        # q4_0: code i of a group in the low nibble of byte i, code i + 16 in its high one
        q = cache[0]
        n = q.shape[2] * q.shape[3]
        at = (blk * q.shape[1] + h) * n
        if values:  # a row of bytes per token; its groups' halves 16 values apart
            for e in range(n):
                m, i = e // half, e % half
                b = np.int32(flat[np.uint64(at + e)])
                dst[m * GROUP + i] = np.float32((b & 15) - 8)
                dst[m * GROUP + half + i] = np.float32((b >> 4) - 8)
        else:  # group g's 16 rows of bytes hold its rows g*32.. (low) and g*32+16.. (high)
            run = half * q.shape[3]
            for g in range(q.shape[2] // half):
                src, lo = at + g * run, 2 * g * run
                for e in range(run):
                    b = np.int32(flat[np.uint64(src + e)])
                    dst[np.uint64(lo + e)] = np.float32((b & 15) - 8)
                for e in range(run):
                    b = np.int32(flat[np.uint64(src + e)])
                    dst[np.uint64(lo + run + e)] = np.float32((b >> 4) - 8)

    return impl


def codes_flat(cache):
    """A quantized cache's codes as one 1-D view (an empty array for a float cache)."""


@overload(codes_flat)
def _codes_flat_impl(cache):
    if isinstance(cache, types.BaseTuple):
        return lambda cache: cache[0].reshape(-1)
    return lambda cache: np.empty(0, np.int8)


def groups(cache, values):
    """Scale groups per head of a quantized K (values False) or V cache; 0 for a float one."""


@overload(groups)
def _groups_impl(cache, values):
    if isinstance(cache, types.BaseTuple):
        return lambda cache, values: cache[1].shape[3] if values else cache[1].shape[2]
    return lambda cache, values: 0


def gather_scales(cache, table, b_start, b_end, h0, h1, out, values):
    """A quantized cache's scales of heads h0..h1-1 over the logical blocks [b_start, b_end) of
    block-table row `table` -> out[h - h0, group, key] as float32; nothing for a float cache."""


@overload(gather_scales)
def _gather_scales_impl(cache, table, b_start, b_end, h0, h1, out, values):
    if not isinstance(cache, types.BaseTuple):
        return lambda cache, table, b_start, b_end, h0, h1, out, values: None

    def impl(cache, table, b_start, b_end, h0, h1, out, values):
        s = cache[1]
        bs = s.shape[2] if values else s.shape[3]
        for b in range(b_start, b_end):
            blk, j0 = table[b], (b - b_start) * bs
            for h in range(h0, h1):
                for g in range(out.shape[1]):
                    for t in range(bs):
                        d = s[blk, h, t, g] if values else s[blk, h, g, t]
                        out[h - h0, g, j0 + t] = _to_f32(d)

    return impl


def k_shape(kc):
    """-> (kv heads, head_dim, block_size) of a K cache."""


def v_shape(vc):
    """-> (kv heads, block_size, v head dim) of a V cache."""


@overload(k_shape)
def _k_shape_impl(kc):
    if isinstance(kc, types.BaseTuple):
        return lambda kc: (kc[0].shape[1], kc[1].shape[2] * GROUP, kc[0].shape[3])
    return lambda kc: (kc.shape[1], kc.shape[2], kc.shape[3])


@overload(v_shape)
def _v_shape_impl(vc):
    if isinstance(vc, types.BaseTuple):
        return lambda vc: (vc[0].shape[1], vc[0].shape[2], vc[1].shape[3] * GROUP)
    return lambda vc: (vc.shape[1], vc.shape[2], vc.shape[3])


def in_place(cache, buf):
    """-> (whether fma_tile can read the cache's blocks in place, the array it reads then): a
    float cache itself, a q8_0 one its codes (its scales applied apart); never a q4_0 one (buf
    only types the branch not taken)."""


@overload(in_place)
def _in_place_impl(cache, buf):
    if not isinstance(cache, types.BaseTuple):
        return lambda cache, buf: (True, cache)
    if cache[0].dtype == types.int8:
        return lambda cache, buf: (True, cache[0])
    return lambda cache, buf: (False, buf)


def line_hints(cache, first, second, split):
    """-> simd.fma_tile's hints over a float16 cache read in place, (cache, first, second,
    split): a line a step of its tiles (see attention._over_blocks); None for the other caches,
    which take prefetch_heads before each head instead."""


@overload(line_hints)
def _line_hints_impl(cache, first, second, split):
    if isinstance(cache, types.Array) and cache.dtype == types.uint16:
        return lambda cache, first, second, split: (cache, first, second, split)
    return lambda cache, first, second, split: None


def prefetch_heads(cache, blk, h0, h1):
    """Hint that heads h0..h1-1 of block blk will be read soon."""


@overload(prefetch_heads)
def _prefetch_heads_impl(cache, blk, h0, h1):
    if isinstance(cache, types.BaseTuple):

        def impl(cache, blk, h0, h1):
            _prefetch_array(cache[0], blk, h0, h1)
            _prefetch_array(cache[1], blk, h0, h1)

        return impl
    return lambda cache, blk, h0, h1: _prefetch_array(cache, blk, h0, h1)


@njit(cache=True, inline="always")
def _prefetch_array(a, blk, h0, h1):
    # a: [num_blocks, nkv, rows, cols]: heads h0..h1-1 of block blk are one stretch
    block = a.shape[2] * a.shape[3]
    at = (blk * a.shape[1] + h0) * block
    for k in range(0, (h1 - h0) * block, LINE // a.itemsize):
        prefetch(a, at + k)


def held_shape(cache, head_axis: int) -> tuple[int, ...]:
    """The [blocks, kv heads, rows, cols] of values a K (head_axis 2) or V (3) cache holds,
    checking a quantized pair's arrays against each other."""
    if not isinstance(cache, tuple):
        if cache.ndim != 4 or cache.dtype not in (np.uint16, np.float32):
            raise ValueError(f"a KV cache array is 4-D uint16 or float32, not {cache.dtype}")
        return cache.shape
    codes, scales = cache
    per_byte = {np.dtype(np.int8): 1, np.dtype(np.uint8): 2}.get(codes.dtype)
    if per_byte is None or scales.dtype != np.uint16 or codes.ndim != 4 or scales.ndim != 4:
        raise ValueError(
            "a quantized KV cache is 4-D int8 (q8_0) or uint8 (q4_0) codes with 4-D uint16"
            f" (float16) scales, not {codes.dtype} {codes.ndim}-D and {scales.dtype}"
        )
    shape = list(codes.shape)
    shape[head_axis] *= per_byte
    want = list(shape)
    want[head_axis] //= GROUP
    if shape[head_axis] % GROUP or list(scales.shape) != want:
        raise ValueError(
            f"quantized KV cache codes of shape {codes.shape} and scales of shape {scales.shape}"
            f" do not match (one scale per {GROUP} values of a head)"
        )
    return tuple(shape)
