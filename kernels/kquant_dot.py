"""A K-quant super-block's dot product with int8 activations, built as LLVM IR from the type's
bit layout (see `Layout`): one intrinsic per type, shared code for all.

The 256 weights are 8 groups of 32. A group's unsigned fields q (2 to 6 bits, from one or two
byte arrays) are multiplied by 32 activations as bytes (`simd._byte_pair_sums`: vpmaddubsw on
x86), the 16-bit pair sums by their integer sub-block scales (vpmaddwd), and the 32-bit lanes
summed over the super-block: one conversion to float and one multiply by d * dx per super-block,
where 16-bit products converted and scaled every 16 weights (1.5-2x slower, measured on Q4_K
and Q6_K). llama.cpp's AVX2 K-quant kernels take the same route.

Every mask and shift is a multiple of `one`, a 1 that LLVM cannot see (floatbits.opaque_u8):
with constants it bounds the fields (a 4-bit field times a byte cannot reach the 16-bit
saturation), drops the saturation and with it the byte multiply-add.
"""

from typing import NamedTuple

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .simd import (
    _I8,
    _I16,
    _I32,
    LANES,
    _activations,
    _add_to,
    _byte_pair_sums,
    _load,
    _pair_sums,
    _pick,
    _ptr,
    _scaled,
    _splat,
    _vec,
)

GROUPS, GROUP = 8, 32  # 32-weight groups per super-block


class Field(NamedTuple):
    """Bits of a group's q from 32 bytes: (block[at : at + 32] >> shift) & (2**bits - 1),
    placed at bit `position` of q."""

    at: int
    shift: int
    bits: int
    position: int = 0


class Layout(NamedTuple):
    """A K-quant type's super-block, group by group.

    fields[g]: the Fields making group g's q; scale_index[g]: the indices of the scales of its
    two 16-weight halves in the super-block's 16 scales; scales_at: None when the scales come as
    values (8 per 32 weights or 16 per 16, decoded by the unit), or the byte offset of 16 scale
    bytes (signed int8, or unsigned with scale_mask applied); offset: subtracted from every q
    (0 for types with minimums, which the unit folds in itself)."""

    fields: tuple
    scale_index: tuple
    scales_at: int | None = None
    scale_signed: bool = True
    scale_mask: int = 0xFF
    offset: int = 0


def _field(context, builder, w_type, w, off, field, one):
    ptr = _ptr(context, builder, w_type, w, builder.add(off, ir.Constant(off.type, field.at)))
    b = _load(builder, ptr, _vec(_I8, GROUP))
    if field.shift:
        b = builder.lshr(b, _opaque_splat(builder, one, field.shift))
    b = builder.and_(b, _opaque_splat(builder, one, (1 << field.bits) - 1))
    if field.position:
        b = builder.shl(b, _splat(builder, ir.Constant(_I8, field.position), GROUP))
    return b


def _opaque_splat(builder, one, value):
    # value * one, in every byte lane (see the module docstring)
    return _splat(builder, builder.mul(one, ir.Constant(_I8, value)), GROUP)


def _scale_vector(context, builder, layout, w_type, w, off, scales_type, scales):
    # -> <16 x i16>: the super-block's scales, one per 16 weights
    if layout.scales_at is not None:
        at = builder.add(off, ir.Constant(off.type, layout.scales_at))
        raw = _load(builder, _ptr(context, builder, w_type, w, at), _vec(_I8, 16))
        if layout.scale_mask != 0xFF:
            raw = builder.and_(raw, _splat(builder, ir.Constant(_I8, layout.scale_mask), 16))
        widen = builder.sext if layout.scale_signed else builder.zext
        return widen(raw, _vec(_I16, 16))
    count = scales_type.count
    v = ir.Constant(_vec(_I16, 16), None)
    for i in range(16):
        value = builder.trunc(builder.extract_value(scales, i * count // 16), _I16)
        v = builder.insert_element(v, value, ir.Constant(_I32, i))
    return v


def super_block_dot(layout: Layout):
    """-> intrinsic dot(acc, w, off, x, xi, xs, xsi, scales, scale, one): acc[0:8] += scale *
    partial sums of sum_g sum_l sc * (q - offset) * x over the super-block at w[off:], with
    x[xi:xi+256] int8 activations and xs[xsi:xsi+16] their sums per 16 (read only when the
    layout has an offset); scales: the scale values (a tuple) or anything when the layout reads
    them from the block; one: floatbits.opaque_u8 of 1."""

    @intrinsic
    def dot(typingctx, acc, w, off, x, xi, xs, xsi, scales, scale, one):
        def codegen(context, builder, sig, args):
            acc, w, off, x, xi, xs, xsi, scales, scale, one = args
            w_type = sig.args[1]
            sc = _scale_vector(context, builder, layout, w_type, w, off, sig.args[7], scales)
            total = None
            for g in range(GROUPS):
                q = None
                for field in layout.fields[g]:
                    bits = _field(context, builder, w_type, w, off, field, one)
                    q = bits if q is None else builder.or_(q, bits)
                xg = builder.add(xi, ir.Constant(xi.type, GROUP * g))
                xv = _activations(context, builder, sig.args[3], x, xg)
                lo, hi = layout.scale_index[g]
                group_scales = _pick(builder, sc, [lo] * 8 + [hi] * 8)
                part = _pair_sums(builder, _byte_pair_sums(builder, q, xv), group_scales)
                total = part if total is None else builder.add(total, part)
            if layout.offset:
                sums = _load(builder, _ptr(context, builder, sig.args[5], xs, xsi), _vec(_I32, 16))
                weighted = builder.mul(builder.sext(sc, _vec(_I32, 16)), sums)
                weighted = builder.add(
                    _pick(builder, weighted, range(8)), _pick(builder, weighted, range(8, 16))
                )
                offset = _splat(builder, ir.Constant(_I32, layout.offset), LANES)
                total = builder.sub(total, builder.mul(weighted, offset))
            _add_to(context, builder, sig.args[0], acc, [_scaled(builder, total, scale)])
            return context.get_dummy_value()

        return types.void(acc, w, off, x, xi, xs, xsi, scales, types.float32, types.uint8), codegen

    return dot
