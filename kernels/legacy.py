"""The legacy quantized units: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, blocks of 32 weights with a float16
scale d at byte 0, and what `Block` says of the rest.

4-bit quants: byte j of 16 holds element j (low nibble) and element j + 16 (high nibble).
5-bit quants: those nibbles, plus bit j of a little-endian uint32 qh as bit 4 of element j.
8-bit quants: 32 int8. w = d * (q - offset), or d * q + m for the types with a float16 min m.

From a type's `Block`, the block's dequantizer and its dot product for the fused small-n kernel
(`block_matmul`), built as LLVM IR from `simd`'s parts: x is quantized to int8 blocks of 32 with
their sums (for Q8_0 without 256-bit VNNI: int16 blocks, no sums; see act_shape), and a block's
offset folds out of its integer dot product as offset * sum(xq), its min out of the float sum as
m * dx * sum(xq).
"""

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgeinfer.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .block_matmul import ROWS
from .byte_gemm import QK, store_in_lane_order
from .simd import (
    _I8,
    _I16,
    _I32,
    VNNI_256,
    _accumulate_bytes,
    _accumulate_dot,
    _activations,
    _dequant_nibbles,
    _fifth_bits,
    _load,
    _nibbles,
    _ptr,
    _read_half,
    _row_lanes,
    _splat,
    _store_dequantized,
    _vec,
)
from .units import build, jit_copy

T = GGMLQuantizationType
BLOCK = 32


class Block(NamedTuple):
    """A legacy block after its scale d (bytes 0-1): `bits`-bit quants at byte qs_at (for 5 bits,
    their fifth bits at qh_at), a float16 min at min_at (0: none), an offset subtracted from
    every q."""

    bits: int
    qs_at: int
    qh_at: int = 0
    min_at: int = 0
    offset: int = 0


def _quants(builder, block: Block, at):
    # -> <32 x i8>: the block's q (at(k): a pointer to its byte k), nibbles low ones first
    if block.bits == 4:
        return _nibbles(builder, at(block.qs_at))
    if block.bits == 5:
        return _fifth_bits(builder, at(block.qs_at), at(block.qh_at))
    return _load(builder, at(block.qs_at), _vec(_I8, 32))


def _block_access(context, builder, w_type, w, off, halves_type, halves):
    # -> (at(k): a pointer to byte k of the block at w[off:], half(k): the float16 there, read
    # through halves, floatbits.HALF_TABLE)
    def at(k):
        return _ptr(context, builder, w_type, w, builder.add(off, ir.Constant(off.type, k)))

    def half(k):
        return _read_half(context, builder, at(k), halves_type, halves)

    return at, half


def block_dequantizer(block: Block):
    """-> intrinsic dequant(w, i, halves, out, o): out[o : o + 32] = the block at w[i:] as gguf
    computes it, d * (q - offset) (+ m), each operation rounded as written (halves:
    floatbits.HALF_TABLE, for d and m). Straight-line vector code: Numba's loop over a block
    would run vector bodies behind runtime checks."""

    @intrinsic
    def dequant(typingctx, w, i, halves, out, o):
        def codegen(context, builder, sig, args):
            w, i, halves, out, o = args

            def at(k):
                k = ir.Constant(i.type, k)
                return _ptr(context, builder, sig.args[0], w, builder.add(i, k))

            def half(k):
                return _read_half(context, builder, at(k), sig.args[2], halves)

            d = half(0)
            m = half(block.min_at) if block.min_at else None
            dst = _ptr(context, builder, sig.args[3], out, o)
            minus = ir.Constant(_I32, block.offset)
            if block.bits == 4:
                _dequant_nibbles(builder, at(block.qs_at), dst, 16, minus, (d, m), (d, m), True)
            else:
                _store_dequantized(builder, dst, _quants(builder, block, at), minus, d, m)
            return context.get_dummy_value()

        return types.void(w, i, halves, out, o), codegen

    return dequant


def block_dot(block: Block):
    """-> intrinsic dot(acc, sums, w, o0, o1, o2, o3, x, xs, b, dx, halves, one), a block dot
    product for block_matmul, of ROWS weight rows at once (block r at w[o_r:]) and the
    activations x[32 * b : 32 * (b + 1)] (int8 as bytes, unsigned q; int16 for 8-bit q), xs[b]
    their sum: acc[r, 0:8] += partial sums of d_r * dx * (sum(q_r * x) - offset * xs[b]), and
    for the types with a min sums[r] += m_r * dx * xs[b]: the rows' mins as one vector, each
    row's operations as they would be for that row alone.
    halves: floatbits.HALF_TABLE; one: floatbits.opaque_one (see simd._byte_pair_sums)."""

    @intrinsic
    def dot(typingctx, acc, sums, w, o0, o1, o2, o3, x, xs, b, dx, halves, one):
        def codegen(context, builder, sig, args):
            acc, sums, w, *offsets, x, xs, b, dx, halves, one = args
            rows = [
                _block_access(context, builder, sig.args[2], w, off, sig.args[11], halves)
                for off in offsets
            ]

            def times_dx(k):
                # <ROWS x float>: the float16 at byte k of each row's block, times dx
                v = ir.Constant(_vec(ir.FloatType(), ROWS), None)
                for r, (_, half) in enumerate(rows):
                    v = builder.insert_element(v, half(k), ir.Constant(_I32, r))
                return builder.fmul(v, _splat(builder, dx, ROWS))

            # a type with a min takes its rows' scales as one vector too (Q4_1 at 7 activation
            # rows: 0.94x the time of scalar ones); for the others that costs more than it saves
            scales = times_dx(0) if block.min_at else None

            def x_sum():
                return builder.load(_ptr(context, builder, sig.args[8], xs, b))

            xi = builder.mul(b, ir.Constant(b.type, BLOCK))
            xv = _activations(context, builder, sig.args[7], x, xi)
            offset = 128 if block.bits == 8 else block.offset  # 8-bit: see below
            minus = ir.Constant(_I32, 0)
            if offset and not _word_products(block):
                minus = builder.mul(x_sum(), ir.Constant(_I32, offset))
            for r, (at, half) in enumerate(rows):
                lanes = _row_lanes(context, builder, sig.args[0], acc, r)
                if scales is None:
                    scale = builder.fmul(half(0), dx)
                else:
                    scale = builder.extract_element(scales, ir.Constant(_I32, r))
                q = _quants(builder, block, at)
                if _word_products(block):
                    _accumulate_dot(builder, lanes, q, xv, scale)
                    continue
                if block.bits == 8:  # signed q as unsigned q + 128: one vpdpbusd, see act_shape
                    q = builder.xor(q, _splat(builder, ir.Constant(_I8, 0x80), 32))
                _accumulate_bytes(builder, lanes, q, xv, minus, scale, one)
            if block.min_at:
                x_total = _splat(builder, builder.sitofp(x_sum(), ir.FloatType()), ROWS)
                part = builder.fmul(times_dx(block.min_at), x_total)
                ptr = _ptr(context, builder, sig.args[1], sums, ir.Constant(_I32, 0))
                ptr = builder.bitcast(ptr, part.type.as_pointer())
                builder.store(builder.fadd(builder.load(ptr, align=4), part), ptr, align=4)
            return context.get_dummy_value()

        f32, u8 = types.float32, types.uint8
        return types.void(acc, sums, w, o0, o1, o2, o3, x, xs, b, f32, halves, u8), codegen

    return dot


def block_unpacker(block: Block):
    """-> intrinsic unpack(w, off, halves, wq, wq_at, sw, sw_at, fm, fm_at), the int8 GEMM's
    unpacking (int8_gemm.int8_matmul) of the block at w[off:]: wq[wq_at:][:32] = q - offset as
    int16, sw[sw_at] = d, and for the types with a min fm[fm_at] = m (halves:
    floatbits.HALF_TABLE)."""

    @intrinsic
    def unpack(typingctx, w, off, halves, wq, wq_at, sw, sw_at, fm, fm_at):
        def codegen(context, builder, sig, args):
            w, off, halves, wq, wq_at, sw, sw_at, fm, fm_at = args

            at, half = _block_access(context, builder, sig.args[0], w, off, sig.args[2], halves)

            wide = _vec(_I16, BLOCK)
            q = _quants(builder, block, at)
            q = builder.sext(q, wide) if block.bits == 8 else builder.zext(q, wide)
            if block.offset:
                q = builder.sub(q, _splat(builder, ir.Constant(_I16, block.offset), BLOCK))
            ptr = _ptr(context, builder, sig.args[3], wq, wq_at)
            builder.store(q, builder.bitcast(ptr, wide.as_pointer()), align=2)
            builder.store(half(0), _ptr(context, builder, sig.args[5], sw, sw_at))
            if block.min_at:
                builder.store(half(block.min_at), _ptr(context, builder, sig.args[7], fm, fm_at))
            return context.get_dummy_value()

        return types.void(w, off, halves, wq, wq_at, sw, sw_at, fm, fm_at), codegen

    return unpack


def block_byte_unpacker(block: Block):
    """-> intrinsic unpack(w, off, halves, wb, wb_at, ws, ws_at, wm, wm_at), the byte GEMM's
    unpacking (byte_gemm.byte_matmul) of the block at w[off:], whose values start at wb_at in
    natural order (a multiple of 32): its q as unsigned bytes (Q8_0's plus 128) in byte_gemm's
    lane order, and for its two 16-value sub-blocks ws[ws_at:][:2] = d and wm[wm_at:][:2] = m,
    or -offset * d (offset 128 for Q8_0; halves: floatbits.HALF_TABLE)."""

    @intrinsic
    def unpack(typingctx, w, off, halves, wb, wb_at, ws, ws_at, wm, wm_at):
        def codegen(context, builder, sig, args):
            w, off, halves, wb, wb_at, ws, ws_at, wm, wm_at = args

            at, half = _block_access(context, builder, sig.args[0], w, off, sig.args[2], halves)

            def const(value):
                return ir.Constant(wb_at.type, value)

            q = _quants(builder, block, at)
            offset = block.offset
            if block.bits == 8:  # signed: flip the sign bit, q + 128
                q = builder.xor(q, _splat(builder, ir.Constant(_I8, 0x80), BLOCK))
                offset = 128
            # the block's first value in lane order: its super-block's bytes, lane (wb_at mod QK)
            # / 16, byte_position being linear in the lane
            within = builder.srem(wb_at, const(QK))
            first = builder.add(builder.sub(wb_at, within), builder.sdiv(within, const(4)))
            store_in_lane_order(context, builder, sig.args[3], wb, first, q)
            d = half(0)
            m = (
                half(block.min_at)
                if block.min_at
                else builder.fmul(d, ir.Constant(d.type, -offset))
            )
            for array, arg, at_, value in ((ws, 5, ws_at, d), (wm, 7, wm_at, m)):
                pair = _splat(builder, value, 2)
                ptr = _ptr(context, builder, sig.args[arg], array, at_)
                builder.store(pair, builder.bitcast(ptr, pair.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(w, off, halves, wb, wb_at, ws, ws_at, wm, wm_at), codegen

    return unpack


TYPE_SIZE, DEQUANTIZE_BLOCK = 0, None  # _dequantize_row's globals, set per type


# raw: [nb * TYPE_SIZE] (one row) -> out: [nb * 32] (a template: see units.jit_copy)
def _dequantize_row(raw, halves, out):
    for b in range(raw.shape[0] // TYPE_SIZE):
        DEQUANTIZE_BLOCK(raw, b * TYPE_SIZE, halves, out, b * BLOCK)


def _word_products(block: Block) -> bool:
    # 8-bit q times int16 activations (vpmaddwd), where no vpdpbusd takes the block as bytes
    return block.bits == 8 and not VNNI_256


def act_shape(block: Block) -> tuple:
    """-> (sum_group, q_type) of the activations block_dot takes (see act_quant): int8 with
    their sums per block; for 8-bit q, int16 and no sums (16-bit products, neither offset nor
    min to fold out), except where one vpdpbusd takes the block (VNNI_256) as q + 128 times
    the int8 activations, less 128 times their sum."""
    if _word_products(block):
        return 0, np.int16
    return BLOCK, np.int8


def legacy_unit(qtype: GGMLQuantizationType, block: Block, small_n_max: int):
    row_globals = dict(
        TYPE_SIZE=GGML_QUANT_SIZES[qtype][1], DEQUANTIZE_BLOCK=block_dequantizer(block)
    )
    row = jit_copy(_dequantize_row, f"{qtype.name.lower()}_row", row_globals)
    acts = act_shape(block)
    # Prompt rows take the int8 GEMM for Q8_0 only, whose rows took its fused int8 kernel before
    # (1.05-1.2x slower); the 4- and 5-bit types keep float prompt rows in every mode. The byte
    # GEMM would run them at 1.5-2.1x their float row tiles (AVX-512 VNNI and AVX2, an Intel
    # core, n = 512), but their int8 prompt rows cost the most accuracy: KL(exact || fast) on
    # SmolLM2's Q4_1 4.4e-4 -> 2.5e-3, on Gemma 3 270M (81 Q5_0 tensors) 3.7e-3 -> 4.9e-3, past
    # llama.cpp's 4.4e-3 (bench/accuracy.py kl, f16 KV, the same Intel machine).
    int8 = dict(unpack=block_unpacker(block), min_groups=1 if block.min_at else 0)
    int8.update(unpack_bytes=block_byte_unpacker(block), q_bits=block.bits)
    int8.update(int8_faster=block.bits == 8)
    # Rows of a verify pass or of a few sequences share each block's unpacking where it costs
    # about as much as the products: 5-bit blocks and 4-bit ones with a min (at 5 to 7 rows of
    # [1536, 576], 0.68-0.78x the time, Q4_1 0.83-0.88x). Q4_0's nibbles and Q8_0's bytes cost
    # less than keeping the rows' sums in memory (1.03-1.2x).
    int8.update(shared_unpacking=block.bits == 5 or block.min_at > 0)
    return build(qtype, row, block_dot(block), *acts, small_n_max=small_n_max, **int8)


# small_n_max: where the row-tile kernel becomes faster (Q8_0's 16-bit products keep up longest);
# Q5_0's shared unpacking keeps it ahead through 7 rows (0.89-0.90x the row tiles' time at 7, with
# AVX-512 VNNI and on Zen 3's AVX2), where Q5_1's is even (0.97-1.07x at 6 and 7)
Q4_0 = legacy_unit(T.Q4_0, Block(4, qs_at=2, offset=8), small_n_max=7)
Q4_1 = legacy_unit(T.Q4_1, Block(4, qs_at=4, min_at=2), small_n_max=7)
Q5_0 = legacy_unit(T.Q5_0, Block(5, qs_at=6, qh_at=2, offset=16), small_n_max=7)
Q5_1 = legacy_unit(T.Q5_1, Block(5, qs_at=8, qh_at=4, min_at=2), small_n_max=5)
Q8_0 = legacy_unit(T.Q8_0, Block(8, qs_at=2), small_n_max=32)
