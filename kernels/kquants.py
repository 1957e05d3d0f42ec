"""The K-quant units: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, super-blocks of 256 weights.

Per type, the serial row dequantizer and the super-block's bit layout (`kquant_dot.Layout`),
from which `kquant_dot.super_block_dot` builds the block dot product of the fused small-n kernel
(`block_matmul`). x is quantized there like llama.cpp's q8_K: int8 per 256-block with one float
scale, plus sums of every 16 int8 values, which fold the K-quant minimums and offsets out of
the dot products.

Scales stay in the file's bytes (no repack; extra_nbytes is block_matmul's 16-byte part table):
unpacking them costs a few integer operations per 256 weights, little next to the weights' own
unpacking.
"""

import numpy as np
from numba import njit

from edgeinfer.gguf.constants import GGMLQuantizationType

from .block_matmul import SHARED_ROWS
from .byte_gemm import VNNI as BYTE_DOT_PRODUCTS
from .floatbits import read_half
from .kquant_dot import (
    GROUPS,
    QK_K,
    SUM_GROUP,
    Field,
    Layout,
    min_groups,
    q_bits,
    super_block_byte_unpacker,
    super_block_dot,
    super_block_unpacker,
)
from .simd import dequant_q6_quarters, dequant_u4_pair, dequant_u5_sub
from .units import build

T = GGMLQuantizationType
I32 = np.int32


def kquant_unit(qtype: GGMLQuantizationType, dequantize_row, layout: Layout, small_n_max: int):
    # small_n_max: where the row-tile kernel becomes faster. Where the byte GEMM runs on VNNI it
    # takes only the rows past SHARED_ROWS: up to there each super-block is unpacked once for all
    # the rows (block_matmul_shared), and each row of a verify pass gets the bits of a one-row step.
    if BYTE_DOT_PRODUCTS:
        small_n_max = min(small_n_max, SHARED_ROWS)
    dot = super_block_dot(layout)
    # int8_faster: 1.35-2.2x the float row tiles a core (Zen 3, n = 512); int8_rows: 1.2-2.3x
    # them at n = 13..64 as well (Zen 3, 2 threads, 64 MB weights)
    int8 = dict(
        unpack=super_block_unpacker(layout),
        min_groups=min_groups(layout),
        unpack_bytes=super_block_byte_unpacker(layout),
        q_bits=q_bits(layout),
        int8_faster=True,
        int8_rows=True,
        shared_unpacking=BYTE_DOT_PRODUCTS,
    )
    return build(qtype, dequantize_row, dot, SUM_GROUP, small_n_max=small_n_max, **int8)


# w: uint8 bytes, off: offset of a Q4_K/Q5_K block's 12 scale bytes, j: sub-block 0..7
# -> (scale, min), 6 bits each
@njit(cache=True, inline="always")
def scale_min_k4(w, off, j):
    if j < 4:
        return I32(w[off + j] & 63), I32(w[off + j + 4] & 63)
    sc = (w[off + j + 4] & 0x0F) | ((w[off + j - 4] >> 6) << 4)
    m = (w[off + j + 4] >> 4) | ((w[off + j] >> 6) << 4)
    return I32(sc), I32(m)


# Q2_K: 84 bytes, w = d*sc_j*q - dmin*m_j, q in 0..3. Scales [0:16] (low nibble: 4-bit scale,
# high nibble: 4-bit min, one per 16 weights), qs [16:80], d f16 [80:82], dmin f16 [82:84].
# Element e = 128*h + 32*s + l takes bits 2s..2s+1 of qs[32*h + l].
# raw: [nb*84] uint8 (one row) -> out: [nb*256] float32
@njit(cache=True)
def q2_k_row(raw, halves, out):
    nb = raw.shape[0] // 84
    for b in range(nb):
        blk = raw[b * 84 : (b + 1) * 84]
        o = out[b * QK_K : (b + 1) * QK_K]
        d = read_half(halves, blk, 80)
        dmin = read_half(halves, blk, 82)
        for j in range(16):  # 16-element sub-blocks
            dl = d * np.float32(blk[j] & 0x0F)
            ml = dmin * np.float32(blk[j] >> 4)
            q0 = 16 + 32 * (j >> 3) + 16 * (j & 1)
            shift = 2 * ((j >> 1) & 3)
            for l in range(16):
                o[16 * j + l] = dl * np.float32((blk[q0 + l] >> shift) & 3) - ml


# group g = 4h + s: elements 128h + 32s + l, bits 2s..2s+1 of qs byte 32h + l; its 16-weight
# halves scaled by the low nibbles of scale bytes 2g and 2g + 1 (minimums: the high ones)
Q2_K_FIELDS = tuple((Field(16 + 32 * (g // 4), 2 * (g % 4), 2),) for g in range(GROUPS))
Q2_K_LAYOUT = Layout(Q2_K_FIELDS, "nibbles", 80, dmin_at=82)
Q2_K = kquant_unit(T.Q2_K, q2_k_row, Q2_K_LAYOUT, 24)


# Q3_K: 110 bytes, w = d*(sc_j - 32)*(q - 4*(1 - hbit)), q in 0..3. hmask [0:32] (bit i of byte
# l: high bit of element 32*i + l, set = no -4 offset), qs [32:96] (2-bit values laid out as in
# Q2_K), 16 x 6-bit scales packed [96:108], d f16 [108:110].


# w: bytes, o: offset of a block, j: 16-element sub-block 0..15 -> signed 6-bit scale (-32..31)
@njit(cache=True, inline="always")
def scale_q3k(w, o, j):
    lo = (w[o + 96 + (j & 7)] >> (4 * (j >> 3))) & 0x0F
    hi = (w[o + 104 + (j & 3)] >> (2 * (j >> 2))) & 3
    return np.int32(lo | (hi << 4)) - 32


# raw: [nb*110] uint8 (one row) -> out: [nb*256] float32
@njit(cache=True)
def q3_k_row(raw, halves, out):
    for b in range(raw.shape[0] // 110):
        blk = raw[b * 110 : (b + 1) * 110]
        o = out[b * QK_K : (b + 1) * QK_K]
        d = read_half(halves, blk, 108)
        for j in range(16):
            dl = d * np.float32(scale_q3k(blk, 0, j))
            q0 = 32 + 32 * (j >> 3) + 16 * (j & 1)
            shift = 2 * ((j >> 1) & 3)
            hbit = j >> 1  # element 16*j + l sits in 32-element group j >> 1
            l0 = 16 * (j & 1)
            for l in range(16):
                q = np.int32((blk[q0 + l] >> shift) & 3)
                if not (blk[l0 + l] >> hbit) & 1:
                    q -= 4
                o[16 * j + l] = dl * np.float32(q)


# group g = 4h + s: bits 2s..2s+1 of qs byte 32h + l, and hmask bit g of byte l as bit 2 (set:
# no -4), so q - 4 with q = low | hbit << 2; its 16-weight halves scaled by scales 2g, 2g + 1
Q3_K_FIELDS = tuple(
    (Field(32 + 32 * (g // 4), 2 * (g % 4), 2), Field(0, g, 1, 2)) for g in range(GROUPS)
)
Q3_K_LAYOUT = Layout(Q3_K_FIELDS, "signed6", 108, scales_at=96, offset=4)
Q3_K = kquant_unit(T.Q3_K, q3_k_row, Q3_K_LAYOUT, 24)


SIXTEENTH = np.float32(1.0 / 16)  # a nibble's weight in the high half of its byte


# Q4_K: 144 bytes, w = d*sc_j*q - dmin*m_j, q in 0..15. d f16 [0:2], dmin f16 [2:4], 8 x (6-bit
# scale, 6-bit min) packed [4:16], qs [16:144]: byte c*32+l holds sub-block 2c (low nibble) and
# 2c+1 (high nibble), element l.
# raw: [nb*144] uint8 (one row) -> out: [nb*256] float32, w = dl * q - ml per sub-block (as
# simd.dequant_u4_pair's dl * q + (-ml): the same bits); the high nibble taken in place against
# dl / 16, which is exact, so the products are bit-identical to dl * q.
@njit(cache=True)
def q4_k_row(raw, halves, out):
    for b in range(raw.shape[0] // 144):
        i = b * 144
        d, dmin = read_half(halves, raw, i), read_half(halves, raw, i + 2)
        for c in range(4):  # 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high
            sc0, m0 = scale_min_k4(raw, i + 4, 2 * c)
            sc1, m1 = scale_min_k4(raw, i + 4, 2 * c + 1)
            dl0, ml0 = d * np.float32(sc0), dmin * np.float32(m0)
            dl1, ml1 = d * np.float32(sc1) * SIXTEENTH, dmin * np.float32(m1)
            dequant_u4_pair(raw, i + 16 + 32 * c, dl0, -ml0, dl1, -ml1, out, b * QK_K + 64 * c)


# sub-block j (32 weights): the low nibbles (j even) or high nibbles of qs bytes 32 * (j // 2)..
Q4_K_FIELDS = tuple((Field(16 + 32 * (j // 2), 4 * (j % 2), 4),) for j in range(GROUPS))
Q4_K_LAYOUT = Layout(Q4_K_FIELDS, "packed6", 0, 2, 4)
Q4_K = kquant_unit(T.Q4_K, q4_k_row, Q4_K_LAYOUT, 12)


# Q5_K: 176 bytes, w = d*sc_j*q - dmin*m_j, q in 0..31. d f16 [0:2], dmin f16 [2:4], 8 x (6-bit
# scale, 6-bit min) packed [4:16], qh [16:48]: bit j of byte l is the 5th bit of element l of
# sub-block j, qs [48:176]: low 4 bits, laid out as in Q4_K.
# raw: [nb*176] uint8 (one row) -> out: [nb*256] float32, w = dl * q - ml per sub-block (as
# simd.dequant_u5_sub's dl * q + (-ml): the same bits)
@njit(cache=True)
def q5_k_row(raw, halves, out):
    for b in range(raw.shape[0] // 176):
        i = b * 176
        d, dmin = read_half(halves, raw, i), read_half(halves, raw, i + 2)
        for j in range(8):
            sc, m = scale_min_k4(raw, i + 4, j)
            dl = d * np.float32(sc)
            ml = dmin * np.float32(m)
            q_at = i + 48 + (j >> 1) * 32
            dequant_u5_sub(raw, q_at, 4 * (j & 1), i + 16, j, dl, -ml, out, b * QK_K + j * 32)


# sub-block j: low 4 bits as in Q4_K, bit j of qh byte l as bit 4 of element l
Q5_K_FIELDS = tuple(
    (Field(48 + 32 * (j // 2), 4 * (j % 2), 4), Field(16, j, 1, 4)) for j in range(GROUPS)
)
Q5_K_LAYOUT = Layout(Q5_K_FIELDS, "packed6", 0, 2, 4)
Q5_K = kquant_unit(T.Q5_K, q5_k_row, Q5_K_LAYOUT, 12)


# Q6_K: 210 bytes, w = d*sc_j*(q - 32), q in 0..63, sc_j int8. ql [0:128], qh [128:192], scales
# int8 [192:208] (one per 16 weights), d f16 [208:210]. Element e = 128*h + 32*s + l (h half, s
# quarter, l 0..31): low 4 bits from ql[64*h + 32*(s & 1) + l] (nibble s >> 1), high 2 bits from
# qh[32*h + l] >> 2*s.


# b: a byte -> its value as int8 (-128..127)
@njit(cache=True, inline="always")
def i8(b):
    v = I32(b)
    return v - ((v & 0x80) << 1)


# raw: [nb*210] uint8 (one row) -> out: [nb*256] float32; each 16 positions of a half's four
# quarters in one simd.dequant_q6_quarters (d * (q - 32) as gguf computes it, bit for bit)
@njit(cache=True)
def q6_k_row(raw, halves, out):
    for b in range(raw.shape[0] // 210):
        i = b * 210
        d = read_half(halves, raw, i + 208)
        for h in range(2):  # 128-element halves: 4 groups of 32, each in two scale groups of 16
            for half in range(2):
                sc = i + 192 + 8 * h + half
                d0 = d * np.float32(i8(raw[sc]))
                d1 = d * np.float32(i8(raw[sc + 2]))
                d2 = d * np.float32(i8(raw[sc + 4]))
                d3 = d * np.float32(i8(raw[sc + 6]))
                lo, hi = i + 64 * h + 16 * half, i + 128 + 32 * h + 16 * half
                at = b * QK_K + 128 * h + 16 * half
                dequant_q6_quarters(raw, lo, hi, d0, d1, d2, d3, out, at)


# group g = 4h + s: elements 128h + 32s + l (low 4 bits in ql, 2 high bits in qh; see above),
# its two 16-weight halves scaled by the int8 scales 2g and 2g + 1
Q6_K_FIELDS = tuple(
    (
        Field(64 * (g // 4) + 32 * (g % 2), 4 * ((g % 4) // 2), 4),
        Field(128 + 32 * (g // 4), 2 * (g % 4), 2, 4),
    )
    for g in range(GROUPS)
)
Q6_K_LAYOUT = Layout(Q6_K_FIELDS, "int8", 208, scales_at=192, offset=32)
Q6_K = kquant_unit(T.Q6_K, q6_k_row, Q6_K_LAYOUT, 12)
