"""A K-quant super-block's dot product with int8 activations, built as LLVM IR from the type's
bit layout (see `Layout`): one intrinsic per type, shared code for all.

The 256 weights are 8 groups of 32. A group's unsigned fields q (2 to 6 bits, from one or two
byte arrays) are multiplied by 32 activations as bytes (`simd._byte_pair_sums`: vpmaddubsw on
x86), the 16-bit pair sums by their integer sub-block scales (vpmaddwd), and the 32-bit lanes
summed over the super-block: one conversion to float and one multiply by d * dx per super-block
rather than every 16 weights (llama.cpp's AVX2 K-quant kernels take the same route). With VNNI a
group's bytes take one vpdpbusd and its scales one vpdpwssd; with AVX-512 VNNI two groups share
each 512-bit instruction, and their lanes fold into 8 at the end, the same integer sums (with GFNI
too, each field of the two groups is one bit-matrix instruction, vgf2p8affineqb). Group g's
16-weight halves take the super-block's scales 2g and 2g + 1 (one per 16 weights; a type with
one per 32 repeats each).

Masks and shifts are constants; `one` (floatbits.opaque_one) is what keeps LLVM from bounding
the fields and dropping the byte multiply-add where it is not named (see simd._byte_pair_sums).
"""

from typing import NamedTuple

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .byte_gemm import STEP, lane_order_steps
from .simd import (
    _F32,
    _I8,
    _I16,
    _I32,
    GFNI_512,
    LANES,
    VNNI_256,
    VNNI_512,
    _activations,
    _add_to,
    _affine_bytes,
    _bit_matrix,
    _byte_pair_sums,
    _lanes,
    _load,
    _pair_sums,
    _pick,
    _ptr,
    _read_half,
    _row_lanes,
    _scaled,
    _splat,
    _vec,
    _vnni,
)

GROUPS, GROUP = 8, 32  # 32-weight groups per super-block
SPAN = 2 if VNNI_512 else 1  # groups per byte dot-product instruction (VNNI): 256 or 512 bits
QK_K = GROUPS * GROUP
SUM_GROUP = 16  # activation sums per 16 values: the finest scale group of any K-quant


class Field(NamedTuple):
    """Bits of a group's q from 32 bytes: (block[at : at + 32] >> shift) & (2**bits - 1),
    placed at bit `position` of q."""

    at: int
    shift: int
    bits: int
    position: int = 0


class Layout(NamedTuple):
    """A K-quant type's super-block, group by group.

    fields[g]: the Fields making group g's q; scales: where the scales (and minimums) come
    from, one of SCALE_SOURCES, read at byte scales_at of the block; d_at, dmin_at: the byte
    offsets of the float16 super-block scale and, for the types with minimums, minimum scale;
    offset: subtracted from every q."""

    fields: tuple
    scales: str
    d_at: int
    dmin_at: int | None = None
    scales_at: int = 0
    offset: int = 0


# "int8": 16 signed bytes (Q6_K); "nibbles": 16 bytes, scale in the low nibble, minimum in the
# high one (Q2_K); "packed6": 12 bytes holding 8 6-bit scales and 8 6-bit minimums (Q4_K,
# Q5_K); "signed6": 12 bytes holding 16 6-bit scales, stored plus 32 (Q3_K).
SCALE_SOURCES = ("int8", "nibbles", "packed6", "signed6")
_WITH_MINS = ("nibbles", "packed6")


def _field_bytes(context, builder, w_type, w, off, field, n=GROUP):
    # -> <n x i8>: the n bytes of the super-block at w[off:] from field.at on
    ptr = _ptr(context, builder, w_type, w, builder.add(off, ir.Constant(off.type, field.at)))
    return _load(builder, ptr, _vec(_I8, n))


def _field(context, builder, w_type, w, off, field):
    b = _field_bytes(context, builder, w_type, w, off, field)
    if field.shift:
        b = builder.lshr(b, _splat(builder, ir.Constant(_I8, field.shift), GROUP))
    if field.shift + field.bits < 8:
        b = builder.and_(b, _splat(builder, ir.Constant(_I8, (1 << field.bits) - 1), GROUP))
    if field.position:
        b = builder.shl(b, _splat(builder, ir.Constant(_I8, field.position), GROUP))
    return b


def _group_q(context, builder, layout, w_type, w, off, g):
    # -> <32 x i8>: group g's unsigned fields q of the super-block at w[off:]
    q = None
    for field in layout.fields[g]:
        bits = _field(context, builder, w_type, w, off, field)
        q = bits if q is None else builder.or_(q, bits)
    return q


def _span_q(context, builder, layout, w_type, w, off, g):
    # -> <64 x i8>: groups g and g + 1's q (as _group_q), each field of the two in one
    # vgf2p8affineqb, the bytes of either group by its own bit matrix: one instruction where
    # masks, shifts and a 256-bit insert took two to four
    def load(field, n=GROUP):
        return _field_bytes(context, builder, w_type, w, off, field, n)

    q = None
    for a, b in zip(layout.fields[g], layout.fields[g + 1], strict=True):
        if a.at == b.at:  # the same 32 bytes in both halves (a broadcast load)
            v = _pick(builder, load(a), list(range(GROUP)) * 2)
        elif b.at == a.at + GROUP:
            v = load(a, 2 * GROUP)
        else:
            v = builder.shuffle_vector(load(a), load(b), _lanes(2 * GROUP))
        matrices = [_bit_matrix(f.shift, f.bits, f.position) for f in (a, b)]
        bits = _affine_bytes(builder, v, [matrices[0]] * 4 + [matrices[1]] * 4)
        q = bits if q is None else builder.or_(q, bits)
    return q


def _scales_and_mins(context, builder, layout, w_type, w, off):
    # -> (<16 x i16> scales, <16 x i32> minimums or None): one per 16 weights
    at = builder.add(off, ir.Constant(off.type, layout.scales_at))
    if layout.scales in ("packed6", "signed6"):
        # 12 bytes, loaded as such: Q3_K's are 2 bytes from the end of its super-block, and a
        # 16-byte load would read past the last super-block of a weight
        raw = _load(builder, _ptr(context, builder, w_type, w, at), _vec(_I8, 12))
        raw = _pick(builder, raw, list(range(12)) + [0] * 4)
    else:
        raw = _load(builder, _ptr(context, builder, w_type, w, at), _vec(_I8, 16))
    if layout.scales == "signed6":
        return _signed6(builder, raw), None
    if layout.scales == "int8":
        return builder.sext(raw, _vec(_I16, 16)), None
    if layout.scales == "nibbles":
        low = builder.and_(raw, _splat(builder, ir.Constant(_I8, 15), 16))
        high = builder.lshr(raw, _splat(builder, ir.Constant(_I8, 4), 16))
        return builder.zext(low, _vec(_I16, 16)), builder.zext(high, _vec(_I32, 16))
    sc, mins = _packed6(builder, raw)
    per_16 = [i // 2 for i in range(16)]  # each 32-weight sub-block's value twice
    return (
        _pick(builder, builder.zext(sc, _vec(_I16, 8)), per_16),
        _pick(builder, builder.zext(mins, _vec(_I32, 8)), per_16),
    )


def _signed6(builder, b):
    # b: <16 x i8>, 12 scale bytes first -> <16 x i16>: scale j = (b[j % 8] >> 4 * (j // 8)) & 15
    # | ((b[8 + j % 4] >> 2 * (j // 4)) & 3) << 4, minus 32
    def const(value):
        return _splat(builder, ir.Constant(_I8, value), 16)

    def lanes_below(n):
        return ir.Constant(_vec(ir.IntType(1), 16), [int(j < n) for j in range(16)])

    low = _pick(builder, b, list(range(8)) * 2)
    low = builder.select(lanes_below(8), builder.and_(low, const(15)), builder.lshr(low, const(4)))
    high = _pick(builder, b, [8, 9, 10, 11] * 4)
    quarter = [builder.and_(builder.lshr(high, const(2 * k)), const(3)) for k in range(4)]
    high = builder.select(
        lanes_below(4),
        quarter[0],
        builder.select(
            lanes_below(8), quarter[1], builder.select(lanes_below(12), quarter[2], quarter[3])
        ),
    )
    sc = builder.zext(builder.or_(low, builder.shl(high, const(4))), _vec(_I16, 16))
    return builder.sub(sc, _splat(builder, ir.Constant(_I16, 32), 16))


def _packed6(builder, b):
    # b: <16 x i8>, the 12 scale bytes first -> (<8 x i8> scales, <8 x i8> minimums), 6 bits
    # each: j < 4: b[j] & 63, b[j + 4] & 63; j >= 4: b[j + 4] & 15 | (b[j - 4] >> 6) << 4,
    # b[j + 4] >> 4 | (b[j] >> 6) << 4. In 32-bit words u0, u1, u2 (llama.cpp's utmp), the four
    # words of scales 0-3, 4-7, minimums 0-3, 4-7 are one vector's lanes: u0 & 0x3f.., u2 &
    # 0x0f.. | (u0 >> 6 & 0x03..) << 4, u1 & 0x3f.., u2 >> 4 & 0x0f.. | (u1 >> 6 & 0x03..) << 4
    def words(values):
        return ir.Constant(_vec(_I32, 4), values)

    u = builder.bitcast(b, _vec(_I32, 4))
    low = builder.lshr(_pick(builder, u, [0, 2, 1, 2]), words([0, 0, 0, 4]))
    low = builder.and_(low, words([0x3F3F3F3F, 0x0F0F0F0F] * 2))
    top = builder.and_(
        builder.lshr(_pick(builder, u, [0, 0, 1, 1]), words([6] * 4)), words([0, 0x03030303] * 2)
    )
    both = builder.bitcast(builder.or_(low, builder.shl(top, words([4] * 4))), _vec(_I8, 16))
    return _pick(builder, both, range(8)), _pick(builder, both, range(8, 16))


def _half_at(context, builder, w_type, w, off, at, halves_type, halves):
    # the float16 at w[off + at], read through halves (floatbits.HALF_TABLE)
    ptr = _ptr(context, builder, w_type, w, builder.add(off, ir.Constant(off.type, at)))
    return _read_half(context, builder, ptr, halves_type, halves)


def _half_times(context, builder, w_type, w, off, at, halves_type, halves, dx):
    # the float16 at w[off + at], read through halves, times dx
    return builder.fmul(_half_at(context, builder, w_type, w, off, at, halves_type, halves), dx)


def super_block_dot(layout: Layout):
    """-> intrinsic dot(acc, sums, w, o0, o1, o2, o3, x, xs, b, dx, halves, one), a block dot
    product for block_matmul, of ROWS weight rows (super-block b of row r at w[o_r:]):
    acc[r, 0:8] += partial sums of d * dx * sum_j sc_j * sum((q - offset) * x) -
    dmin * dx * sum_j m_j * sum(x) (j: the super-block's 16-weight sub-blocks; d, dmin: its
    float16 scales, read through halves, floatbits.HALF_TABLE), with x[256 * b : 256 * (b + 1)]
    int8 activations and xs[16 * b : 16 * (b + 1)] their sums per 16; one:
    floatbits.opaque_one. sums (a scalar part per row) is left as it is."""
    assert layout.scales in SCALE_SOURCES, layout.scales
    assert (layout.dmin_at is not None) == (layout.scales in _WITH_MINS), layout

    @intrinsic
    def dot(typingctx, acc, sums, w, o0, o1, o2, o3, x, xs, b, dx, halves, one):
        def codegen(context, builder, sig, args):
            acc, _, w, *offsets, x, xs, b, dx, halves, one = args
            w_type, halves_type = sig.args[2], sig.args[11]
            xi = builder.mul(b, ir.Constant(b.type, QK_K))
            xsi = builder.mul(b, ir.Constant(b.type, QK_K // SUM_GROUP))
            if layout.offset or layout.dmin_at is not None:
                x_sums = _ptr(context, builder, sig.args[8], xs, xsi)
                x_sums = _load(builder, x_sums, _vec(_I32, 16))

            def times_dx(off, at):
                return _half_times(context, builder, w_type, w, off, at, halves_type, halves, dx)

            for r, off in enumerate(offsets):
                weights, acts = (w_type, w, off), (sig.args[7], x, xi)
                sc, mins = _scales_and_mins(context, builder, layout, w_type, w, off)
                if VNNI_256:
                    total = _scaled_quad_sums(context, builder, layout, weights, acts, sc)
                else:
                    total = _scaled_pair_sums(context, builder, layout, weights, acts, sc, one)
                if layout.offset:
                    offset = _splat(builder, ir.Constant(_I32, layout.offset), LANES)
                    total = builder.sub(total, builder.mul(_per_16(builder, sc, x_sums), offset))
                parts = [_scaled(builder, total, times_dx(off, layout.d_at))]
                if mins is not None:
                    min_scale = builder.fneg(times_dx(off, layout.dmin_at))
                    parts.append(_scaled(builder, _per_16(builder, mins, x_sums), min_scale))
                _add_to(builder, _row_lanes(context, builder, sig.args[0], acc, r), parts)
            return context.get_dummy_value()

        f32, u8 = types.float32, types.uint8
        return types.void(acc, sums, w, o0, o1, o2, o3, x, xs, b, f32, halves, u8), codegen

    return dot


def _scaled_quad_sums(context, builder, layout, weights, acts, sc):
    # weights: (w type, w, off), acts: (x type, x, xi), the super-block's -> <8 x i32> lanes of
    # sum_j sc_j * sum(q * x) (j: its 16-weight sub-blocks), lane i the sums of each group's bytes
    # 4i .. 4i + 3: SPAN groups a vpdpbusd (sums of 4 products a 32-bit lane) and a vpdpwssd by
    # their scales; integer sums, so the same bits in any order and at any SPAN. The vpdpwssd
    # make two chains at 256 bits, where one of 8 (4-5 cycles each) bounded a row, and one of 4
    # at 512 bits, where LLVM splits a second chain's vpdpwssd into vpmaddwd and vpaddd, one more
    # instruction on AVX-512's two 512-bit ports (Q4_K 0.94x the speed, Intel Xeon).
    chains = 1 if SPAN == 2 else 2
    lanes = LANES * SPAN
    zero = ir.Constant(_vec(_I32, lanes), [0] * lanes)
    x_type, x, xi = acts
    totals = [zero] * chains
    for s, first in enumerate(range(0, GROUPS, SPAN)):
        groups = range(first, first + SPAN)
        if SPAN == 2 and GFNI_512:
            q = _span_q(context, builder, layout, *weights, first)
        else:
            q = [_group_q(context, builder, layout, *weights, g) for g in groups]
            q = q[0] if SPAN == 1 else builder.shuffle_vector(q[0], q[1], _lanes(2 * GROUP))
        ptr = _ptr(
            context, builder, x_type, x, builder.add(xi, ir.Constant(xi.type, GROUP * first))
        )
        quads = _vnni(builder, "vpdpbusd", zero, q, _load(builder, ptr, _vec(_I8, GROUP * SPAN)))
        scales = _quad_scales(builder, sc, groups)
        totals[s % chains] = _vnni(builder, "vpdpwssd", totals[s % chains], quads, scales)
    total = totals[0] if chains == 1 else builder.add(totals[0], totals[1])
    if SPAN == 2:  # a 512-bit total: lanes i and i + 8 (the two groups of a span) into lane i
        low, high = _pick(builder, total, range(LANES)), _pick(builder, total, range(LANES, lanes))
        total = builder.add(low, high)
    return total


def _scaled_pair_sums(context, builder, layout, weights, acts, sc, one):
    # as _scaled_quad_sums, without byte dot-product instructions: 16-bit pair sums of each
    # group's bytes (simd._byte_pair_sums) times their scales (vpmaddwd)
    group_scales = _word_group_scales if layout.scales == "signed6" else _group_scales
    x_type, x, xi = acts
    zero = ir.Constant(_vec(_I32, LANES), [0] * LANES)
    totals = [zero, zero]
    for g in range(GROUPS):
        q = _group_q(context, builder, layout, *weights, g)
        xv = _activations(
            context, builder, x_type, x, builder.add(xi, ir.Constant(xi.type, GROUP * g))
        )
        part = _pair_sums(
            builder, _byte_pair_sums(builder, q, xv, one), group_scales(builder, sc, g)
        )
        totals[g % 2] = builder.add(totals[g % 2], part)
    return builder.add(totals[0], totals[1])


def _group_scales(builder, sc, g):
    # sc: <16 x i16>, one scale per 16 weights -> <16 x i16>: group g's two, 8 lanes each. As a
    # byte shuffle of the scales' low bytes and sign bytes (every type's fit a byte): one
    # two-source byte permute (vpermt2b) or pshufb a group, where a word splat (a type with a
    # scale per 32 weights) costs a shift and a broadcast. A super-block's dot product, Zen 4:
    # Q4_K 0.8x the time, Q2_K 0.92x, Q5_K and Q6_K 0.95x; Q3_K 1.4x (its unpacking leaves no
    # registers for the permutes' index vectors: it keeps _word_group_scales)
    low, sign = _scale_bytes(builder, sc)
    scale_of_lane = [2 * g + lane // 8 for lane in range(16)]
    mask = [byte for i in scale_of_lane for byte in (i, 16 + i)]  # its low byte, its sign byte
    mask = ir.Constant(_vec(_I32, 32), mask)
    return builder.bitcast(builder.shuffle_vector(low, sign, mask), _vec(_I16, 16))


def _scale_bytes(builder, sc):
    # sc: <16 x i16>, each scale fits a byte -> (<16 x i8> its low bytes, <16 x i8> its sign bytes)
    low = builder.trunc(sc, _vec(_I8, 16))
    return low, builder.ashr(low, _splat(builder, ir.Constant(_I8, 7), 16))


def _quad_scales(builder, sc, groups):
    # sc: <16 x i16>, one scale per 16 weights -> <16 * len(groups) x i16> for a multiply-add of
    # the groups' <8 x i32> sums of 4 products each (each fits 16 bits) taken as words: word 2j
    # the scale of sum j (of group g = groups[j // 8]: sub-block 2g + j % 8 // 4), word 2j + 1
    # zero, for the sum's upper word
    low, sign = _scale_bytes(builder, sc)
    scales = builder.shuffle_vector(low, sign, _lanes(32))
    zeros = ir.Constant(_vec(_I8, 32), [0] * 32)
    mask = []
    for g in groups:
        for j in range(8):
            i = 2 * g + j // 4
            mask += [i, 16 + i, 32, 32]  # the scale's low byte, its sign byte, a zero word
    mask = ir.Constant(_vec(_I32, len(mask)), mask)
    return builder.bitcast(
        builder.shuffle_vector(scales, zeros, mask), _vec(_I16, 16 * len(groups))
    )


def _word_group_scales(builder, sc, g):
    # as _group_scales, as a word shuffle (vpermw)
    return _pick(builder, sc, [2 * g] * 8 + [2 * g + 1] * 8)


def _per_16(builder, values, sums):
    # values: <16 x i16|i32>, sums: <16 x i32> -> <8 x i32> lanes of sum(values * sums)
    weighted = builder.mul(
        builder.sext(values, _vec(_I32, 16)) if values.type.element.width < 32 else values, sums
    )
    return builder.add(_pick(builder, weighted, range(8)), _pick(builder, weighted, range(8, 16)))


def q_bits(layout: Layout) -> int:
    """The bits of the type's unsigned q (its fields', placed)."""
    return max(f.position + f.bits for fields in layout.fields for f in fields)


def min_groups(layout: Layout) -> int:
    """Minimums per super-block in the int8 GEMM's unpacked form (int8_gemm): one per scale of
    a type with minimums (8 for packed6, 16 for nibbles), 0 without."""
    if layout.scales not in _WITH_MINS:
        return 0
    return GROUPS if layout.scales == "packed6" else 2 * GROUPS


def super_block_unpacker(layout: Layout):
    """-> intrinsic unpack(w, off, halves, wq, wq_at, sw, sw_at, fm, fm_at), the int8 GEMM's
    unpacking (int8_gemm.int8_matmul) of the super-block at w[off:]: wq[wq_at:][:256] =
    sc_j * (q - offset) as int16 (sc_j: the integer scale of the weight's 16-weight sub-block),
    sw[sw_at] = d, and for the types with minimums fm[fm_at:][:min_groups(layout)] =
    -dmin * m_j (halves: floatbits.HALF_TABLE)."""
    groups = min_groups(layout)

    @intrinsic
    def unpack(typingctx, w, off, halves, wq, wq_at, sw, sw_at, fm, fm_at):
        def codegen(context, builder, sig, args):
            w, off, halves, wq, wq_at, sw, sw_at, fm, fm_at = args
            w_type, halves_type = sig.args[0], sig.args[2]
            sc, mins = _scales_and_mins(context, builder, layout, w_type, w, off)
            wide = _vec(_I16, GROUP)
            for g in range(GROUPS):
                q = _group_q(context, builder, layout, w_type, w, off, g)
                q = builder.zext(q, wide)
                if layout.offset:
                    q = builder.sub(q, _splat(builder, ir.Constant(_I16, layout.offset), GROUP))
                q = builder.mul(q, _pick(builder, sc, [2 * g] * 16 + [2 * g + 1] * 16))
                at = builder.add(wq_at, ir.Constant(wq_at.type, GROUP * g))
                ptr = _ptr(context, builder, sig.args[3], wq, at)
                builder.store(q, builder.bitcast(ptr, wide.as_pointer()), align=2)

            def half(at):
                return _half_at(context, builder, w_type, w, off, at, halves_type, halves)

            builder.store(half(layout.d_at), _ptr(context, builder, sig.args[5], sw, sw_at))
            if groups:
                m = mins if groups == 16 else _pick(builder, mins, range(0, 16, 2))
                m = builder.sitofp(m, _vec(_F32, groups))
                m = builder.fmul(m, _splat(builder, builder.fneg(half(layout.dmin_at)), groups))
                ptr = _ptr(context, builder, sig.args[7], fm, fm_at)
                builder.store(m, builder.bitcast(ptr, m.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(w, off, halves, wq, wq_at, sw, sw_at, fm, fm_at), codegen

    return unpack


def super_block_byte_unpacker(layout: Layout):
    """-> intrinsic unpack(w, off, halves, wb, wb_at, ws, ws_at, wm, wm_at), the byte GEMM's
    unpacking (byte_gemm.byte_matmul) of the super-block at w[off:]: wb[wb_at:][:256] = the
    unsigned fields q in byte_gemm's lane order, and per 16-weight sub-block j (16 of them)
    ws[ws_at + j] = d * sc_j and wm[wm_at + j] = -dmin * m_j - offset * d * sc_j, the float
    terms that its sum of q * x is scaled by and that multiply its sum of x (halves:
    floatbits.HALF_TABLE)."""

    @intrinsic
    def unpack(typingctx, w, off, halves, wb, wb_at, ws, ws_at, wm, wm_at):
        def codegen(context, builder, sig, args):
            w, off, halves, wb, wb_at, ws, ws_at, wm, wm_at = args
            w_type, halves_type = sig.args[0], sig.args[2]
            sc, mins = _scales_and_mins(context, builder, layout, w_type, w, off)
            groups = [_group_q(context, builder, layout, w_type, w, off, g) for g in range(GROUPS)]
            # whole steps, shuffled in registers: a store per word costs more than the products
            # of a few activation rows
            for s, step in enumerate(lane_order_steps(builder, groups)):
                at = builder.add(wb_at, ir.Constant(wb_at.type, s * STEP))
                ptr = builder.bitcast(
                    _ptr(context, builder, sig.args[3], wb, at), step.type.as_pointer()
                )
                builder.store(step, ptr, align=1)

            def half(at):
                return _half_at(context, builder, w_type, w, off, at, halves_type, halves)

            lanes = 2 * GROUPS
            d = _splat(builder, half(layout.d_at), lanes)
            scale = builder.fmul(builder.sitofp(sc, _vec(_F32, lanes)), d)
            minimum = ir.Constant(_vec(_F32, lanes), [0.0] * lanes)
            if mins is not None:
                dmin = _splat(builder, builder.fneg(half(layout.dmin_at)), lanes)
                minimum = builder.fmul(builder.sitofp(mins, _vec(_F32, lanes)), dmin)
            if layout.offset:
                offset = _splat(builder, ir.Constant(_F32, -layout.offset), lanes)
                minimum = builder.fadd(minimum, builder.fmul(scale, offset))
            for array, at, value in ((ws, ws_at, scale), (wm, wm_at, minimum)):
                ptr = _ptr(context, builder, sig.args[5], array, at)
                builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(w, off, halves, wb, wb_at, ws, ws_at, wm, wm_at), codegen

    return unpack
