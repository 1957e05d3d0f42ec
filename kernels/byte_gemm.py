"""The quantized types' int8 GEMM where the compile target has byte multiply-adds: unsigned
weight bytes times int8 activations, each 16-value sub-block's scale applied in float once per
256 values. With AVX-512 VNNI four products are summed per 32-bit lane in one instruction
(vpdpbusd: 64 products, against 32 for int8_gemm's 16-bit multiply-adds); on AVX2 vpmaddubsw
sums byte pairs into 16 bits (32 products), a few steps' pair sums add up in 16 bits where the
q's bits leave room (byte_tile_for; Q8_0's 8-bit q stay on int8_gemm), and one vpmaddwd with
ones widens them to the lanes' 32 bits.

Rows are cut into super-blocks of 256 values (a K-quant's own; eight legacy blocks), each 16
sub-blocks of 16 (a K-quant's finest scale; half a legacy block), and weights and activations
both hold them in lane order (byte_position): four steps of 64 bytes, 32-bit lane j of each step
holding 4 values of sub-block j. Four vpdpbusd leave each sub-block's integer sum of q * xq in
its own lane (AVX2 takes each step's two 256-bit halves, sub-blocks 0-7 and 8-15, on their own),
and

    y = sum over sub-blocks j of  (sum over j of q * xq) * dx[j] * ws[j]  +  wm[j] * xs[j]

with ws[j] the weight's scale there (d * sc_j; a legacy block's d), wm[j] what multiplies the
sub-block's sum of x (-dmin * m_j - offset * d * sc_j; a legacy block's m or -offset * d: Q8_0's
q are stored plus 128), dx[j] the activation block's scale and xs[j] = dx[j] * the sub-block's
sum of xq (int8_gemm's quantize_activations, in blocks of the weight type's: the same rounding
as the 16-bit GEMM). Every output is its own chain of the same operations whatever tile
computes it, and each activation row is rounded on its own: int8_gemm's row-wise contract holds
here too.
"""

from functools import cache

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.extending import intrinsic

from .int8_gemm import (
    TILE_ROWS,
    TileFrame,
    products,
    quantize_activations,
    tile_literals,
    tile_signature,
    unpack_rows,
)
from .simd import (
    _F32,
    _I8,
    _I16,
    _I32,
    LANES,
    VEC_LANES,
    X86_MADD,
    _ptr,
    _vec,
    _vector_fma,
    _vnni,
    _x86_madd,
    counted_loop,
    target_features,
)

QK = 256  # values per super-block
SUBS = 16  # sub-blocks per super-block: one 32-bit lane of a 512-bit vector each
STEP = 4 * SUBS  # bytes per vpdpbusd
HALF_STEPS = QK // STEP  # steps per super-block: 4
MAX_I16 = (1 << 15) - 1

# The targets of the quantized types' int8 GEMM, rather than int8_gemm's: 512-bit vectors (one
# lane per sub-block) and the byte dot-product instruction (VNNI); or AVX2's byte multiply-add
# on 256-bit vectors (MADD), each step's two halves (lanes of sub-blocks 0-7, 8-15) on their own.
VNNI = VEC_LANES == SUBS and "+avx512vnni" in target_features()
MADD = VEC_LANES == LANES and X86_MADD
ENABLED = VNNI or MADD
WIDTH = SUBS if VNNI else LANES  # 32-bit lanes per vector

# Largest tile: BYTE_ROWS weight rows by BYTE_COLS activation rows; their integer sums and float
# accumulators (two vectors a pair) and a vector per activation row fit AVX-512's 32 registers.
# AVX2's 16 registers and its tile's 15 row pointers spill at any shape; 1 x 4 spills least (an
# Intel core compiled for x86-64-v3, 2048 x 8192 by 512 rows, GOPS a core: 111-116 against
# 94-104 for 2 x 2, 2 x 3, 3 x 2, 2 x 4, 3 x 3).
BYTE_ROWS, BYTE_COLS = (4, 3) if VNNI else (1, 4)


def byte_position(value: int) -> int:
    """Where a super-block's value `value` (0 to 255) lies in lane order: lane value // 16 of step
    value % 16 // 4, its byte value % 4."""
    sub, at = divmod(value, SUBS)
    return STEP * (at // 4) + 4 * sub + at % 4


LANE_ORDER = np.array([byte_position(v) for v in range(QK)], np.int64)


def store_in_lane_order(context, builder, array_type, array, first, q):
    """Stores q (<n x i8>, n a multiple of 16: whole sub-blocks of a super-block's values) in
    lane order into array (flat u8), at `first`: the byte where q's first value goes (the
    super-block's start plus byte_position of that value)."""
    count = q.type.count // 4
    words = builder.bitcast(q, _vec(_I32, count))
    for i in range(count):  # word i: values 4 i to 4 i + 3, byte_position(4 i) past the first
        at = builder.add(first, ir.Constant(first.type, byte_position(4 * i)))
        ptr = builder.bitcast(_ptr(context, builder, array_type, array, at), _I32.as_pointer())
        builder.store(builder.extract_element(words, ir.Constant(_I32, i)), ptr, align=1)


def lane_order_steps(builder, groups):
    """groups: a super-block's values as 8 vectors of 32 (<32 x i8>, natural order) -> its 4
    steps in lane order (<16 x i32>): lane j of step s holds values 16 j + 4 s to 16 j + 4 s + 3,
    word s of its half-group, so each half of a step is one two-source word shuffle of 4 groups."""
    words = [builder.bitcast(g, _vec(_I32, 8)) for g in groups]

    def joined(a, b, idx):  # lanes idx of a's lanes then b's
        idx = list(idx)
        return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, len(idx)), idx))

    quads = [
        (joined(words[h], words[h + 1], range(16)), joined(words[h + 2], words[h + 3], range(16)))
        for h in (0, 4)
    ]
    steps = []
    for s in range(4):
        low, high = (joined(a, b, range(s, 32, 4)) for a, b in quads)
        steps.append(joined(low, high, range(16)))
    return steps


def byte_tile_for(bits: int):
    """-> the tile intrinsic (byte_tile's contract) for weights whose unsigned q have `bits` bits,
    or None where this target's byte GEMM cannot take them (AVX2's 16-bit pair sums: q of 8
    bits, Q8_0's q + 128, saturate one)."""
    if VNNI:
        return _tile(HALF_STEPS)
    run = min(HALF_STEPS, MAX_I16 // (2 * 127 * (2**bits - 1)))
    return _tile(run) if MADD and run > 0 else None


@cache
def _tile(run):
    # the tile for a run of `run` steps whose 16-bit pair sums add up without overflow (MADD)
    @intrinsic
    def byte_tile(typingctx, rows, cols, block, min_groups, wb, xb, k, ws, dx, wm, xs, at, out):
        """int8_gemm.int_tile's contract on lane-ordered bytes: for r < rows, c < cols
        (literals, 1 to BYTE_ROWS / BYTE_COLS), with at = (w row, x row, out, out step, first
        and end super-block) in rows of wb (u8) / xb (int8) ([*, k], flattened; k a multiple of
        QK) and elements of out: out[out + r + c * step] (+)= the module docstring's y of weight
        row w + r and activation row x + c over those super-blocks (block = QK, min_groups =
        SUBS; ws, wm, dx, xs: float32 [*, k // SUBS], flattened, the same rows, one value a
        sub-block); super-block 0 stores, a later first super-block adds to out."""
        lits = tile_literals(rows, cols, block, min_groups)
        if lits is None:
            return None
        n_rows, n_cols, blk, groups = lits
        if not (1 <= n_rows <= BYTE_ROWS and 1 <= n_cols <= BYTE_COLS):
            return None
        if blk != QK or groups != SUBS:
            return None

        def codegen(context, builder, sig, args):
            frame = TileFrame(context, builder, sig, args)
            k = frame.k
            lanes = builder.sdiv(k, ir.Constant(k.type, SUBS))
            w0, x0 = frame.rows("wq", n_rows, k), frame.rows("xq", n_cols, k)
            ws0, wm0 = frame.rows("sw", n_rows, lanes), frame.rows("fm", n_rows, lanes)
            dx0, xs0 = frame.rows("dx", n_cols, lanes), frame.rows("sx", n_cols, lanes)
            fvec = _vec(_F32, WIDTH)
            fma = _vector_fma(builder, WIDTH)
            pairs = [(r, c) for r in range(n_rows) for c in range(n_cols)]
            zero = ir.Constant(fvec, [0.0] * WIDTH)
            b, phis, close = counted_loop(
                builder, "byte", frame.b_lo, frame.b_hi, [zero] * len(pairs)
            )
            accs = list(phis)
            first = builder.mul(b, ir.Constant(k.type, QK))
            sub = builder.mul(b, ir.Constant(k.type, SUBS))

            def vector(ptr, at, t):
                return builder.load(
                    builder.bitcast(builder.gep(ptr, [at]), t.as_pointer()), align=4
                )

            for h in range(SUBS // WIDTH):
                steps = []  # each step's half h: lanes of sub-blocks WIDTH h to WIDTH (h + 1) - 1
                for s in range(QK // STEP):
                    at_s = builder.add(first, ir.Constant(k.type, s * STEP + h * WIDTH * 4))
                    steps.append(
                        (
                            [vector(p, at_s, _vec(_I8, 4 * WIDTH)) for p in w0],
                            [vector(p, at_s, _vec(_I8, 4 * WIDTH)) for p in x0],
                        )
                    )
                sums = _lane_sums(builder, steps, pairs, run)
                at_h = builder.add(sub, ir.Constant(k.type, h * WIDTH))
                scales = [vector(p, at_h, fvec) for p in ws0]
                minimums = [vector(p, at_h, fvec) for p in wm0]
                x_scales = [vector(p, at_h, fvec) for p in dx0]
                x_sums = [vector(p, at_h, fvec) for p in xs0]
                for i, (r, c) in enumerate(pairs):
                    scale = builder.fmul(scales[r], x_scales[c])
                    acc = builder.call(fma, [builder.sitofp(sums[r, c], fvec), scale, accs[i]])
                    accs[i] = builder.call(fma, [minimums[r], x_sums[c], acc])
            close(accs)
            frame.store(fma, pairs, phis)
            return context.get_dummy_value()

        return tile_signature(rows, cols, block, min_groups, wb, xb, ws, dx, wm, xs, out), codegen

    return byte_tile


def _lane_sums(builder, steps, pairs, run):
    # steps: [(weight vectors, activation vectors)] of one half, as <4 WIDTH x i8> -> {(r, c):
    # <WIDTH x i32>}, lane j the sum of the products in its 4 bytes over the steps: a chain of
    # vpdpbusd (VNNI), or (MADD) vpmaddubsw's pair sums added in 16 bits over runs of `run`
    # steps, each run widened by a vpmaddwd with ones
    ivec = _vec(_I32, WIDTH)
    sums = {}
    for r, c in pairs:
        if VNNI:
            total = ir.Constant(ivec, [0] * WIDTH)
            for w, x in steps:
                total = _vnni(builder, "vpdpbusd", total, w[r], x[c])
            sums[r, c] = total
            continue
        ones = ir.Constant(_vec(_I16, 2 * WIDTH), [1] * (2 * WIDTH))
        total = None
        for first in range(0, len(steps), run):
            pair_sums = None
            for w, x in steps[first : first + run]:
                p = _x86_madd(builder, "pmadd.ub.sw", w[r], x[c], _vec(_I16, 2 * WIDTH))
                pair_sums = p if pair_sums is None else builder.add(pair_sums, p)
            wide = _x86_madd(builder, "pmadd.wd", pair_sums, ones, ivec)
            total = wide if total is None else builder.add(total, wide)
        sums[r, c] = total
    return sums


# x: [n, k] -> (xb int8[n, kp] in lane order, dx, xs float32[n, kp // SUBS]): int8_gemm's
# quantize_activations' rounding (blocks of `block`: 32 or QK) and sums, the values moved to lane
# order, a sub-block's scale and scaled sum per lane; zeros past k, to kp (a multiple of QK)
@njit(cache=True, inline="always")
def quantize_bytes(x, block, kp):
    n, k = x.shape
    xq, dx, sums = quantize_activations(x, block, block // SUBS)
    xb = np.zeros((n, kp), np.int8)
    dxl = np.zeros((n, kp // SUBS), np.float32)
    xs = np.zeros((n, kp // SUBS), np.float32)
    for t in prange(n):
        for v in range(k):
            at = v % QK
            xb[t, v - at + LANE_ORDER[at]] = xq[t, v]
        for j in range(k // SUBS):
            dxl[t, j] = dx[t, j * SUBS // block]
            xs[t, j] = sums[t, j]
    return xb, dxl, xs


# int8_gemm.int8_matmul on this GEMM, for any quantized type's blocks of `block` values (the
# activations rounded in blocks of as many); unpack: its block's (kquant_dot.
# super_block_byte_unpacker, legacy.block_byte_unpacker), tile: byte_tile_for its q's bits.
# Rows shorter than a multiple of QK are zero-padded to one.
@njit(cache=True, inline="always")
def byte_matmul(unpack, tile, flat, starts, ends, halves, x, out, block, block_bytes):
    k = x.shape[1]
    kp = (k + QK - 1) // QK * QK
    acts = quantize_bytes(x, block, kp)
    last = ends[ends.shape[0] - 1]
    for g in prange((last + TILE_ROWS - 1) // TILE_ROWS):
        r0 = g * TILE_ROWS
        m = min(TILE_ROWS, last - r0)
        layout = (block, block_bytes, block // SUBS, block // SUBS)
        weights = unpack_rows(unpack, flat, starts, ends, halves, r0, m, k, layout, np.uint8, kp)
        products(tile, BYTE_ROWS, BYTE_COLS, weights, m, acts, kp, QK, SUBS, out, r0)
