"""Vector building blocks written as portable LLVM IR through Numba intrinsics.

Numba's loop vectorizer widens an int8 dot product to int32 lanes (one vpmulld per 8 products on
x86) and reduces it horizontally at every 32-weight block. Written directly as IR, a block's
dot product is products summed in pairs, shapes LLVM lowers to each target's multiply-add
instructions, and its 8 partial sums are scaled into 8 float lanes that stay lanes until the
row ends:
- unsigned weight fields times int8 activations as bytes (`_byte_pair_sums`: vpmaddubsw on x86,
  widening multiplies on ARM), for every type with unsigned fields (all but Q8_0);
- sign-extended int16 products (`_pair_sums`: vpmaddwd on x86, smull + addp on ARM), for Q8_0
  and to widen or scale the byte sums.
LLVM picks the instructions for the machine it compiles on; a few are named where the target
has them (x86's multiply-adds on AVX2, VNNI's byte dot products, GFNI's bit matrices), each
behind a flag of the compile target's features, the portable shape the fallback.

Every function here reads raw pointers without bounds checks: callers pass 1-D C-contiguous
arrays and offsets they have checked (weight rows validated by the loader, activations of whole
blocks).
"""

import llvmlite.binding as llvm
from llvmlite import ir
from llvmlite.ir.instructions import Instruction
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 8  # float accumulators per row: the width of one 256-bit vector
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()


def target_features() -> set[str]:
    """The features of the code Numba compiles, as its own codegen picks them
    (NUMBA_CPU_FEATURES, else the host's): {"+avx2", "-avx512f", ...}."""
    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return set(features.split(","))


def _wide_vectors() -> bool:
    # Whether the code Numba compiles has 32 vector registers of 512 bits (x86's AVX-512). Only
    # vector widths and dot_tile's shape follow it; the IR stays portable vector code.
    return "+avx512f" in target_features()


# Byte dot products of 256-bit vectors in one instruction (vpdpbusd, vpdpwssd): AVX-512 VNNI with
# 256-bit forms, or AVX-VNNI. The fused kernels use them directly where the target has them.
VNNI_256 = {"+avx512vnni", "+avx512vl"} <= target_features() or "+avxvnni" in target_features()
# and of 512-bit vectors (AVX-512 VNNI)
VNNI_512 = {"+avx512vnni", "+avx512f"} <= target_features()
# A bit matrix applied to every byte of a vector (vgf2p8affineqb), of 256 or 512 bits: any
# shift-and-mask of a byte in one instruction, a different one per 64-bit lane
GFNI_256 = {"+gfni", "+avx"} <= target_features()
GFNI_512 = {"+gfni", "+avx512f"} <= target_features()
# x86's byte and word multiply-adds of 256-bit vectors (vpmaddubsw, vpmaddwd), named as such
# (AVX2): from the portable shapes LLVM lost some to plain multiplies, and the byte one needs an
# OR a group to keep (see _byte_pair_sums)
X86_MADD = "+avx2" in target_features()


# VEC_LANES: floats per vector register of the compile target, the width of dot_tile's
# accumulators and of the dequantizers' steps (the same bits at any width), and dot_tile's
# largest shape (matmul._rows_by): DOT_ROWS * DOT_COLS accumulators plus a vector per activation
# row must fit the register file: 6 x 4 in 32 registers of 16 floats (AVX-512), 5 x 2 in 16 of
# 8 (AVX2), where 6 x 4 would spill.
VEC_LANES, DOT_ROWS, DOT_COLS = (16, 6, 4) if _wide_vectors() else (LANES, 5, 2)


def _vec(t, n):
    return ir.VectorType(t, n)


def _ptr(context, builder, array_type, array, offset):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(data, [offset])


def _load(builder, ptr, t):
    return builder.load(builder.bitcast(ptr, t.as_pointer()), align=1)


def _splat(builder, value, n):
    v = builder.insert_element(ir.Constant(_vec(value.type, n), None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), [0] * n))


def _lanes(n):
    # <n x i32> 0 .. n - 1: a shuffle mask that joins two vectors of n / 2 lanes
    return ir.Constant(_vec(_I32, n), list(range(n)))


def _pick(builder, v, idx):
    idx = list(idx)
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, len(idx)), idx))


def _x86_madd(builder, name, a, b, result):
    # llvm.x86.avx2.<name> (pmadd.ub.sw, pmadd.wd) of a and b -> result (X86_MADD)
    fn = builder.module.declare_intrinsic(
        f"llvm.x86.avx2.{name}", fnty=ir.FunctionType(result, [a.type, b.type])
    )
    return builder.call(fn, [a, b])


def _pair_sums(builder, w, x):
    # w, x: <n x i8 | i16> -> <n/2 x i32>, lane i = w[2i] * x[2i] + w[2i+1] * x[2i+1]: the shape
    # LLVM turns into multiply-add-pairs instructions (vpmaddwd itself for 16 words on AVX2)
    n = w.type.count
    if X86_MADD and w.type == x.type == _vec(_I16, 16):
        return _x86_madd(builder, "pmadd.wd", w, x, _vec(_I32, 8))
    prod = builder.mul(builder.sext(w, _vec(_I32, n)), builder.sext(x, _vec(_I32, n)))
    return builder.add(_pick(builder, prod, range(0, n, 2)), _pick(builder, prod, range(1, n, 2)))


class _Freeze(Instruction):
    # LLVM's `freeze` (llvmlite's builder has none): the value unchanged, and a wall that keeps
    # the optimizer from moving the shuffles below (even and odd bytes) into the value's sources
    def __init__(self, parent, value):
        super().__init__(parent, value.type, "freeze", [value])

    def descr(self, buf):
        (value,) = self.operands
        buf.append(f"freeze {value.type} {value.get_reference()}\n")


def _freeze(builder, value):
    instr = _Freeze(builder.block, value)
    builder._insert(instr)
    return instr


def _byte_pair_sums(builder, q, x, one):
    # q: <32 x i8> unsigned < 64, x: <32 x i8> signed -> <16 x i16>, lane i = q[2i] * x[2i] +
    # q[2i+1] * x[2i+1], saturated to 16 bits: the unsigned-by-signed byte multiply-add
    # (vpmaddubsw on x86), in the shape LLVM selects it from. Nothing ever saturates
    # (2 * 63 * 128 < 2**15), but LLVM keeps the saturation, and so the shape, only while it
    # cannot bound q: q is ORed with one - 1, a 0 it cannot see (one: floatbits.opaque_one).
    # On AVX2 the instruction itself, which needs no such OR.
    if X86_MADD:
        return _x86_madd(builder, "pmadd.ub.sw", q, x, _vec(_I16, 16))
    w32 = _vec(_I32, 16)
    unseen_zero = builder.sub(one, ir.Constant(one.type, 1))
    q = _freeze(builder, builder.or_(q, _splat(builder, unseen_zero, 32)))
    sums = None
    for half in (range(0, 32, 2), range(1, 32, 2)):
        qh = builder.zext(_pick(builder, q, half), w32)
        xh = builder.sext(_pick(builder, x, half), w32)
        prod = builder.mul(qh, xh)
        sums = prod if sums is None else builder.add(sums, prod)
    low = ir.Constant(w32, [-(1 << 15)] * 16)
    high = ir.Constant(w32, [(1 << 15) - 1] * 16)
    sums = builder.select(builder.icmp_signed(">", sums, low), sums, low)
    sums = builder.select(builder.icmp_signed("<", sums, high), sums, high)
    return builder.trunc(sums, _vec(_I16, 16))


def _vnni(builder, name, acc, a, b):
    # llvm.x86.avx512.<name>.<256|512> (vpdpbusd, vpdpwssd) at acc's width (<8|16 x i32>): acc +
    # sums of 4 byte / 2 word products
    ivec = acc.type
    fn = builder.module.declare_intrinsic(
        f"llvm.x86.avx512.{name}.{32 * ivec.count}", fnty=ir.FunctionType(ivec, [ivec] * 3)
    )
    return builder.call(fn, [acc, builder.bitcast(a, ivec), builder.bitcast(b, ivec)])


def _bit_matrix(shift, bits, position=0):
    # -> the GF(2) bit matrix, as vgf2p8affineqb takes it (a qword), taking a byte b to
    # ((b >> shift) & (2**bits - 1)) << position: its byte 7 - o picks the bit output bit o takes
    qword = 0
    for o in range(position, position + bits):
        qword |= (1 << (shift + o - position)) << (8 * (7 - o))
    return qword


def _affine_bytes(builder, v, matrices):
    # v: <32|64 x i8>, matrices: a _bit_matrix per 64-bit lane -> each byte of v times the
    # matrix of its lane (GFNI_256, GFNI_512)
    vec = v.type
    fn = builder.module.declare_intrinsic(
        f"llvm.x86.vgf2p8affineqb.{8 * vec.count}", fnty=ir.FunctionType(vec, [vec, vec, _I8])
    )
    m = builder.bitcast(ir.Constant(_vec(ir.IntType(64), vec.count // 8), matrices), vec)
    return builder.call(fn, [v, m, ir.Constant(_I8, 0)])


def _byte_quad_sums(builder, start, q, x, one):
    # start: <8 x i32>, q: <32 x i8> unsigned, x: <32 x i8> signed -> <8 x i32>, lane i =
    # start[i] + the sum of q[4i + k] * x[4i + k] over k < 4: one vpdpbusd (VNNI_256; any q),
    # else the byte pair sums (q < 64: see _byte_pair_sums) widened by a multiply-add by one
    # (vpmaddwd, where a constant 1 would be folded into four shuffles and extensions)
    if VNNI_256:
        return _vnni(builder, "vpdpbusd", start, q, x)
    if X86_MADD:  # a constant 1 is not folded into vpmaddwd itself
        ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    else:
        ones = _splat(builder, builder.zext(one, _I16), 16)
    return builder.add(start, _pair_sums(builder, _byte_pair_sums(builder, q, x, one), ones))


def _scaled(builder, sums, scale):
    # <8 x i32> -> <8 x float> times scale
    as_float = builder.sitofp(sums, _vec(_F32, LANES))
    return builder.fmul(as_float, _splat(builder, scale, LANES), flags=["contract"])


def _row_lanes(context, builder, acc_type, acc, row):
    # acc: float32[rows, 8], C order -> a <8 x float> pointer to acc[row]
    ptr = _ptr(context, builder, acc_type, acc, ir.Constant(_I32, row * LANES))
    return builder.bitcast(ptr, _vec(_F32, LANES).as_pointer())


def _add_to(builder, lanes, parts):
    # lanes: <8 x float> pointer (_row_lanes); *lanes += sum of parts (<8 x float> each)
    total = builder.load(lanes, align=4)
    for part in parts:
        total = builder.fadd(total, part, flags=["contract"])
    builder.store(total, lanes, align=4)


def _accumulate_dot(builder, lanes, w, x, scale):
    # w, x: <32 x i8 | i16> -> *lanes += scale * (lane i: products 2i, 2i+1, 2i+16, 2i+17)
    pairs = _pair_sums(builder, w, x)
    sums = builder.add(_pick(builder, pairs, range(8)), _pick(builder, pairs, range(8, 16)))
    _add_to(builder, lanes, [_scaled(builder, sums, scale)])


def _activations(context, builder, array_type, array, offset):
    # 32 int8 or int16 activations (int16: no widening per weight row that reuses them)
    t = ir.IntType(array_type.dtype.bitwidth)
    return _load(builder, _ptr(context, builder, array_type, array, offset), _vec(t, 32))


def _nibbles(builder, ptr):
    # 16 bytes at ptr -> <32 x i8>: the low nibbles of bytes 0..15, then their high nibbles
    b = _load(builder, ptr, _vec(_I8, 16))
    if GFNI_256:  # the 16 bytes in both halves, each half's nibbles by one bit matrix
        both = _pick(builder, b, list(range(16)) * 2)
        return _affine_bytes(builder, both, [_bit_matrix(0, 4)] * 2 + [_bit_matrix(4, 4)] * 2)
    low = builder.and_(b, _splat(builder, ir.Constant(_I8, 15), 16))
    high = builder.lshr(b, _splat(builder, ir.Constant(_I8, 4), 16))
    return builder.shuffle_vector(low, high, _lanes(32))


def _fifth_bits(builder, ptr, hi_ptr):
    # -> <32 x i8>: the nibbles of the 16 bytes at ptr, bit j of the uint32 at hi_ptr as bit 4
    # of nibble j
    # (byte j // 8 of the mask in lane j, tested against bit j % 8: a bitcast to <32 x i1>
    # instead is unpacked one lane at a time on aarch64)
    q = _nibbles(builder, ptr)
    mask = _load(builder, hi_ptr, _vec(_I8, 4))
    spread = builder.shuffle_vector(
        mask, mask, ir.Constant(_vec(_I32, 32), [j // 8 for j in range(32)])
    )
    bit = ir.Constant(_vec(_I8, 32), [1 << (j % 8) for j in range(32)])
    zeros = ir.Constant(_vec(_I8, 32), [0] * 32)
    is_set = builder.icmp_unsigned("!=", builder.and_(spread, bit), zeros)
    sixteen = ir.Constant(_vec(_I8, 32), [16] * 32)
    return builder.or_(q, builder.select(is_set, sixteen, zeros))


def _accumulate_bytes(builder, lanes, q, x, minus, scale, one):
    # q: <32 x i8> unsigned, x: <32 x i8> -> *lanes += scale * partial sums of dot(q, x) -
    # minus (an int32, taken from lane 0: a weight offset times the block's activation sum,
    # exact in the integers, where a float term per row cost a conversion and a register)
    zeros = ir.Constant(_vec(_I32, LANES), [0] * LANES)
    start = builder.insert_element(zeros, builder.neg(minus), ir.Constant(_I32, 0))
    sums = _byte_quad_sums(builder, start, q, x, one)
    _add_to(builder, lanes, [_scaled(builder, sums, scale)])


# llvm.prefetch's locality for every hint: 2, into L2 (prefetcht1 on x86, PLDL2KEEP on aarch64)
PREFETCH_LOCALITY = 2
LINE = 64  # bytes per prefetch: a cache line on every target we support


@intrinsic
def prefetch(typingctx, a, i):
    """Hint that a[i] (a 1-D array) will be read soon, fetching it into the L2 cache (not L1);
    safe past the end (a hint never faults).

    Every caller hints bytes far enough ahead to come from DRAM: a hint into L1 holds one of
    the L1's few miss buffers for that whole trip, and those buffers then bound a core's read
    rate (a streaming kernel read half as fast with L1 hints as with L2 ones)."""

    def codegen(context, builder, sig, args):
        _hint(builder, _ptr(context, builder, sig.args[0], args[0], args[1]))
        return context.get_dummy_value()

    return types.void(a, i), codegen


def _hint(builder, ptr):
    # llvm.prefetch of the bytes at ptr (see prefetch)
    ptr = builder.bitcast(ptr, _I8.as_pointer())
    fn = builder.module.declare_intrinsic(
        "llvm.prefetch", [ptr.type], ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32])
    )
    read, cache = ir.Constant(_I32, 0), ir.Constant(_I32, 1)  # a read, of data
    builder.call(fn, [ptr, read, ir.Constant(_I32, PREFETCH_LOCALITY), cache])


@intrinsic
def local_f32(typingctx, count):
    """A pointer to `count` (a literal) float32 slots on the calling function's stack, for
    numba.carray: accumulators there cannot alias any argument, so LLVM keeps them in registers
    and shares loads between the rows that update them (a heap array is stored to memory at
    every block, and every load after a store is repeated). The slots live as long as the
    function whose entry block holds them: call this only from inlined code, and never let the
    array escape it."""
    if not isinstance(count, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        slots = cgutils.alloca_once(builder, ir.ArrayType(_F32, count.literal_value))
        return builder.bitcast(slots, _F32.as_pointer())

    return types.CPointer(types.float32)(count), codegen


@intrinsic
def read_u16(typingctx, w, i):
    """The little-endian uint16 at bytes w[i:i+2], as uint32 (an index without Numba's
    negative-index check: a per-block scale sits in the hot loop)."""

    def codegen(context, builder, sig, args):
        return builder.zext(_load(builder, _ptr(context, builder, sig.args[0], *args), _I16), _I32)

    return types.uint32(w, i), codegen


def _read_half(context, builder, ptr, halves_type, halves):
    # the float16 at ptr (a byte pointer), read through halves (floatbits.HALF_TABLE)
    bits = builder.zext(_load(builder, ptr, _I16), ir.IntType(64))
    return builder.load(_ptr(context, builder, halves_type, halves, bits))


def _store_dequantized(builder, ptr, q, minus, d, m):
    # q: <n x i8 | i32> -> n floats at ptr = d * (q - minus) (+ m), each operation rounded as
    # written: gguf's float32 expression, bit for bit
    n, lane = q.type.count, q.type.element
    q = builder.sub(q, _splat(builder, minus if lane == _I32 else builder.trunc(minus, lane), n))
    w = builder.fmul(builder.sitofp(q, _vec(_F32, n)), _splat(builder, d, n))
    if m is not None:
        w = builder.fadd(w, _splat(builder, m, n))
    builder.store(w, builder.bitcast(ptr, w.type.as_pointer()), align=4)


def _byte_lanes(builder, ptr, first):
    # the VEC_LANES bytes at ptr + first, zero-extended to 32-bit lanes as they are loaded
    # (one instruction per vector on x86 and ARM): no shuffles to widen the halves of a wider
    # byte vector
    b = _load(builder, builder.gep(ptr, [ir.Constant(_I32, first)]), _vec(_I8, VEC_LANES))
    return builder.zext(b, _vec(_I32, VEC_LANES))


def _i32_lanes(v, lanes=VEC_LANES):
    # the constant <lanes x i32> with every lane v
    return ir.Constant(_vec(_I32, lanes), [v] * lanes)


def _dequant_nibbles(builder, src, dst, n_bytes, minus, low, high, shift):
    # the low and the high nibbles of the n_bytes bytes at src -> 2 * n_bytes floats at dst, the
    # low ones first, as _store_dequantized with low = (d, m) and high = (d, m); the high nibbles
    # shifted down (shift) or kept in place (byte & 0xF0, against a scale 16x smaller). The
    # nibbles are split in the 32-bit lanes of _byte_lanes: the same floats as splitting the
    # bytes first (_nibbles).
    for first in range(0, n_bytes, VEC_LANES):
        b = _byte_lanes(builder, src, first)
        lo = builder.and_(b, _i32_lanes(15))
        hi = builder.lshr(b, _i32_lanes(4)) if shift else builder.and_(b, _i32_lanes(0xF0))
        for q, at, (d, m) in ((lo, first, low), (hi, n_bytes + first, high)):
            _store_dequantized(builder, builder.gep(dst, [ir.Constant(_I32, at)]), q, minus, d, m)


@intrinsic
def dequant_u4_pair(typingctx, w, wi, d0, m0, d1, m1, out, oi):
    """out[oi : oi + 32] = d0 * q + m0 for q the low nibbles of the 32 bytes w[wi:wi+32], and
    out[oi + 32 : oi + 64] = d1 * (byte & 0xF0) + m1, their high nibbles in place: two 32-weight
    sub-blocks sharing their bytes, as K-quants store them (d1 a 16th of the sub-block's scale,
    exact, so the products are those of the shifted nibbles)."""

    def codegen(context, builder, sig, args):
        w, wi, d0, m0, d1, m1, out, oi = args
        src = _ptr(context, builder, sig.args[0], w, wi)
        dst = _ptr(context, builder, sig.args[6], out, oi)
        zero = ir.Constant(_I32, 0)
        _dequant_nibbles(builder, src, dst, 32, zero, (d0, m0), (d1, m1), shift=False)
        return context.get_dummy_value()

    f32 = types.float32
    return types.void(w, wi, f32, f32, f32, f32, out, oi), codegen


def _q6_quarters(builder, lo, hi, scales, dst):
    # see dequant_q6_quarters; lo, hi: byte pointers, scales: its four d_i, dst: float pointer
    for first in range(0, 16, VEC_LANES):
        low = (_byte_lanes(builder, lo, first), _byte_lanes(builder, lo, 32 + first))
        top = _byte_lanes(builder, hi, first)
        for i, d in enumerate(scales):
            nib = low[i % 2]
            if i < 2:
                nib = builder.and_(nib, _i32_lanes(15))
            else:
                nib = builder.lshr(nib, _i32_lanes(4))
            two = builder.and_(builder.lshr(top, _i32_lanes(2 * i)), _i32_lanes(3))
            q = builder.or_(nib, builder.shl(two, _i32_lanes(4)))
            at = builder.gep(dst, [ir.Constant(_I32, 32 * i + first)])
            _store_dequantized(builder, at, q, ir.Constant(_I32, 32), d, None)


@intrinsic
def dequant_q6_quarters(typingctx, w, lo, hi, d0, d1, d2, d3, out, oi):
    """Q6_K's 16 positions j of its 4 quarters i: out[oi + 32 * i + j] = d_i * (q - 32), q's low
    4 bits from the low (i = 0, 1) or high (i = 2, 3) nibble of w[lo + j] (i even) or
    w[lo + 32 + j] (i odd), its high 2 bits from bits 2i, 2i + 1 of w[hi + j]. Each VEC_LANES
    bytes widened as they are loaded, as in _dequant_nibbles."""

    def codegen(context, builder, sig, args):
        w, lo, hi, *scales, out, oi = args
        lo_ptr, hi_ptr = (_ptr(context, builder, sig.args[0], w, i) for i in (lo, hi))
        dst = _ptr(context, builder, sig.args[7], out, oi)
        _q6_quarters(builder, lo_ptr, hi_ptr, scales, dst)
        return context.get_dummy_value()

    f32 = types.float32
    return types.void(w, lo, hi, f32, f32, f32, f32, out, oi), codegen


def _five_bit_fields(builder, q_ptr, h_ptr, shift, bit, d, m, dst):
    # see dequant_u5_sub; shift, bit: i32 values
    by_shift, by_bit = (_splat(builder, v, VEC_LANES) for v in (shift, bit))
    for first in range(0, 32, VEC_LANES):
        low, top = (_byte_lanes(builder, p, first) for p in (q_ptr, h_ptr))
        low = builder.and_(builder.lshr(low, by_shift), _i32_lanes(15))
        top = builder.shl(builder.and_(builder.lshr(top, by_bit), _i32_lanes(1)), _i32_lanes(4))
        q = builder.or_(low, top)
        at = builder.gep(dst, [ir.Constant(_I32, first)])
        _store_dequantized(builder, at, q, ir.Constant(_I32, 0), d, m)


@intrinsic
def dequant_u5_sub(typingctx, w, q_at, shift, h_at, bit, d, m, out, oi):
    """out[oi + l] = d * q + m for l < 32, q = (w[q_at + l] >> shift) & 15 with bit `bit` of
    w[h_at + l] as its bit 4: a K-quant's 32-weight sub-block of 5-bit fields (Q5_K), each
    VEC_LANES bytes widened as they are loaded, as in _dequant_nibbles."""

    def codegen(context, builder, sig, args):
        w, q_at, shift, h_at, bit, d, m, out, oi = args
        q_ptr, h_ptr = (_ptr(context, builder, sig.args[0], w, i) for i in (q_at, h_at))
        dst = _ptr(context, builder, sig.args[7], out, oi)
        shift, bit = (builder.trunc(v, _I32) for v in (shift, bit))
        _five_bit_fields(builder, q_ptr, h_ptr, shift, bit, d, m, dst)
        return context.get_dummy_value()

    i, f32 = types.intp, types.float32
    return types.void(w, q_at, i, h_at, i, f32, f32, out, oi), codegen


def _vector_fma(builder, lanes):
    # llvm.fma on <lanes x float>: a fused multiply-add that no fast-math flag can reorder
    vec = _vec(_F32, lanes)
    return builder.module.declare_intrinsic(
        f"llvm.fma.v{lanes}f32", fnty=ir.FunctionType(vec, [vec, vec, vec])
    )


def _fold_lanes(builder, v, combine):
    # <n x float> -> its lanes combined by halves (combine(upper half, v), then its upper
    # quarter, ...): lane 0 of the last
    n = v.type.count
    half = n // 2
    while half:
        v = combine(_pick(builder, v, [i + half if i < half else i for i in range(n)]), v)
        half //= 2
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _lane_sum(builder, fma, v):
    # <n x float> -> the sum of its lanes, halves added pairwise (the order LLVM's own
    # vectorized reductions use), as vector fma(a, 1, b) = a + b: calls on vectors take no
    # fast-math flags from Numba, so no pass reorders them
    one = ir.Constant(v.type, [1.0] * v.type.count)
    return _fold_lanes(builder, v, lambda upper, w: builder.call(fma, [upper, one, w]))


def _partial_lanes(builder, ptr, count, lanes):
    # the count (1 to lanes - 1) floats at ptr, then zeros: only the first count are read
    v = ir.Constant(_vec(_F32, lanes), [0.0] * lanes)
    for lane in range(lanes):
        inside = builder.icmp_signed("<", ir.Constant(count.type, lane), count)
        at = builder.select(inside, ir.Constant(count.type, lane), ir.Constant(count.type, 0))
        value = builder.select(inside, builder.load(builder.gep(ptr, [at])), ir.Constant(_F32, 0))
        v = builder.insert_element(v, value, ir.Constant(_I32, lane))
    return v


def _row_ptr(context, builder, array_type, array, at, k, r):
    # -> a pointer to array's flat data at at + r * k
    row = builder.mul(ir.Constant(k.type, r), k)
    return _ptr(context, builder, array_type, array, builder.add(at, row))


@intrinsic
def dot_tile(typingctx, rows, cols, w, w_at, x, x_at, k, out, out_at, out_step):
    """For r < rows, t < cols (literals, 1 to DOT_ROWS / DOT_COLS):
    out[out_at + r + t * out_step] = the dot product of w[w_at + r * k :][:k] and
    x[x_at + t * k :][:k] (rows of w and of x k apart, past rows / cols not read).

    Each is one chain of fused multiply-adds in VEC_LANES float lanes along k, in order (a last
    partial vector padded with zeros), then its lanes summed in a fixed order, so its bits
    depend neither on the tile's shape nor on the other products: a ragged edge takes a
    smaller tile instead of repeating rows. w, x, out: float32 arrays, offsets into their flat
    data."""
    literal = (isinstance(v, types.IntegerLiteral) for v in (rows, cols))
    if not all(literal) or not (
        1 <= rows.literal_value <= DOT_ROWS and 1 <= cols.literal_value <= DOT_COLS
    ):
        return None
    n_rows, n_cols = rows.literal_value, cols.literal_value

    def codegen(context, builder, sig, args):
        _, _, w, w_at, x, x_at, k, out, out_at, out_step = args
        vec = _vec(_F32, VEC_LANES)
        fma = _vector_fma(builder, VEC_LANES)
        w_type, x_type, out_type = sig.args[2], sig.args[4], sig.args[7]
        w0 = [_row_ptr(context, builder, w_type, w, w_at, k, r) for r in range(n_rows)]
        x0 = [_row_ptr(context, builder, x_type, x, x_at, k, t) for t in range(n_cols)]
        width = ir.Constant(k.type, VEC_LANES)
        zero_i, one_i = ir.Constant(k.type, 0), ir.Constant(k.type, 1)
        zero = ir.Constant(vec, [0.0] * VEC_LANES)
        n_vec = builder.sdiv(k, width)
        pairs = [(r, t) for r in range(n_rows) for t in range(n_cols)]
        entry = builder.block
        body = builder.append_basic_block("dot.body")
        rest = builder.append_basic_block("dot.rest")
        tail = builder.append_basic_block("dot.tail")
        done = builder.append_basic_block("dot.done")
        builder.cbranch(builder.icmp_signed(">", n_vec, zero_i), body, rest)
        # a rotated loop over running pointers: no index arithmetic in the body
        builder.position_at_end(body)
        i = builder.phi(k.type)
        ptrs = [builder.phi(p.type) for p in w0 + x0]
        accs = [builder.phi(vec) for _ in pairs]
        lanes = [_load(builder, p, vec) for p in ptrs]
        new = [
            builder.call(fma, [lanes[r], lanes[n_rows + t], a])
            for (r, t), a in zip(pairs, accs, strict=True)
        ]
        i_next = builder.add(i, one_i)
        ptrs_next = [builder.gep(p, [width]) for p in ptrs]
        builder.cbranch(builder.icmp_signed("<", i_next, n_vec), body, rest)
        i.add_incoming(zero_i, entry)
        i.add_incoming(i_next, body)
        for p, p0, p_next in zip(ptrs, w0 + x0, ptrs_next, strict=True):
            p.add_incoming(p0, entry)
            p.add_incoming(p_next, body)
        for a, a_new in zip(accs, new, strict=True):
            a.add_incoming(zero, entry)
            a.add_incoming(a_new, body)
        builder.position_at_end(rest)
        kept = [builder.phi(vec) for _ in pairs]
        for a, a_new in zip(kept, new, strict=True):
            a.add_incoming(zero, entry)
            a.add_incoming(a_new, body)
        full = builder.mul(n_vec, width)
        left = builder.sub(k, full)
        builder.cbranch(builder.icmp_signed(">", left, zero_i), tail, done)
        builder.position_at_end(tail)
        ends = [_partial_lanes(builder, builder.gep(p, [full]), left, VEC_LANES) for p in w0 + x0]
        last = [
            builder.call(fma, [ends[r], ends[n_rows + t], a])
            for (r, t), a in zip(pairs, kept, strict=True)
        ]
        builder.branch(done)
        builder.position_at_end(done)
        sums = [builder.phi(vec) for _ in pairs]
        for s, a, a_last in zip(sums, kept, last, strict=True):
            s.add_incoming(a, rest)
            s.add_incoming(a_last, tail)
        for (r, t), s in zip(pairs, sums, strict=True):
            col = builder.mul(ir.Constant(out_at.type, t), out_step)
            at = builder.add(out_at, builder.add(ir.Constant(out_at.type, r), col))
            builder.store(_lane_sum(builder, fma, s), _ptr(context, builder, out_type, out, at))
        return context.get_dummy_value()

    i = types.intp
    return types.void(rows, cols, w, i, x, i, k, out, i, i), codegen


def counted_loop(builder, name, start, stop, inits):
    """Opens `for i in range(start, stop)` carrying values that start as `inits` -> (i, their
    phis, close): the builder is in the body; close(new values) branches back and leaves the
    builder after the loop, where the phis hold the final values."""
    entry = builder.block
    head = builder.append_basic_block(f"{name}.head")
    body = builder.append_basic_block(f"{name}.body")
    done = builder.append_basic_block(f"{name}.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(start.type)
    phis = [builder.phi(v.type) for v in inits]
    builder.cbranch(builder.icmp_signed("<", i, stop), body, done)
    builder.position_at_end(body)

    def close(new):
        i_next = builder.add(i, ir.Constant(i.type, 1))
        latch = builder.block  # the body may have opened blocks of its own
        builder.branch(head)
        i.add_incoming(start, entry)
        i.add_incoming(i_next, latch)
        for phi, init, value in zip(phis, inits, new, strict=True):
            phi.add_incoming(init, entry)
            phi.add_incoming(value, latch)
        builder.position_at_end(done)

    return i, phis, close


@intrinsic
def row_max(typingctx, x, at, n):
    """-> the largest of the float32s x[at : at + n] (n >= 1; x C-contiguous). A max does not
    round, so TILE_COLS lanes at a time give the one chain's value (of a tie of -0 and +0,
    either): a compare-and-select chain does not vectorize where Numba cannot flag it as one."""
    if x.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        x, at, n = args
        base = builder.gep(context.make_array(sig.args[0])(context, builder, x).data, [at])
        vec = _vec(_F32, TILE_COLS)
        vmax = builder.module.declare_intrinsic(
            f"llvm.maxnum.v{TILE_COLS}f32", fnty=ir.FunctionType(vec, [vec, vec])
        )
        smax = builder.module.declare_intrinsic(
            "llvm.maxnum.f32", fnty=ir.FunctionType(_F32, [_F32, _F32])
        )
        whole = builder.sdiv(n, ir.Constant(n.type, TILE_COLS))
        lowest = ir.Constant(vec, [float("-inf")] * TILE_COLS)
        i, (acc,), close = counted_loop(builder, "max", ir.Constant(n.type, 0), whole, [lowest])
        at_i = builder.mul(i, ir.Constant(n.type, TILE_COLS))
        close([builder.call(vmax, [acc, _load(builder, builder.gep(base, [at_i]), vec)])])
        first = _fold_lanes(builder, acc, lambda upper, w: builder.call(vmax, [w, upper]))
        tail = builder.mul(whole, ir.Constant(n.type, TILE_COLS))
        j, (m,), close = counted_loop(builder, "max.tail", tail, n, [first])
        close([builder.call(smax, [m, builder.load(builder.gep(base, [j]))])])
        return m

    return types.float32(x, types.intp, types.intp), codegen


# The largest fma_tile the attention takes: each accumulator is its own chain of fused
# multiply-adds, and a core runs two at a time, each taking 4 cycles, so 8 or more chains keep
# it busy. AVX-512's 32 registers hold 8 rows of two column tiles (16 accumulators); AVX2's 16
# (of 8 floats) and NEON's 32 (of 4) hold 4 rows of one, 8 accumulator registers each.
TILE_ROWS = 8 if _wide_vectors() else 4
COL_TILES = 2 if _wide_vectors() else 1
MAX_TILE_ROWS = 8
TILE_COLS = 16  # columns of fma_tile: one vector per row (two on 256-bit targets)

# float16 bits -> float32 without branches (so that it vectorizes on every target): the half,
# sign-extended to 32 bits and shifted left by F16_SHIFT, has its sign, exponent and mantissa in
# float32 position once F16_MASK clears the extension; times F16_REBIAS the exponent is rebiased
# (bias 15 -> 127), exact for normal and subnormal halves alike. (inf/NaN halves, which a usable
# KV cache never holds, come out large and finite.) LLVM's own half conversion is a library call
# Numba cannot link, except where the target converts halves itself: x86 with F16C and every
# aarch64, where fma_tile takes it (one instruction for these four: the same bits).
F16_SHIFT = 13
F16_MASK = -0x70002000  # 0x8FFFE000: sign, then the half's exponent and mantissa
F16_REBIAS = 2.0**112
HALF_CONVERT = "+f16c" in target_features() or llvm.get_process_triple().startswith(
    ("aarch64", "arm64")
)


def _f32_lanes(builder, ptr, elem):
    # TILE_COLS elements at ptr -> <TILE_COLS x float>: elem i16 (float16 bits, widened as
    # above), i8 (integers: a quantized KV cache's codes, whose scales the caller applies) or float
    n = TILE_COLS
    if elem == _F32:
        return _load(builder, ptr, _vec(_F32, n))
    if elem == _I8:
        return builder.sitofp(_load(builder, ptr, _vec(_I8, n)), _vec(_F32, n))
    if HALF_CONVERT:
        halves = builder.bitcast(_load(builder, ptr, _vec(_I16, n)), _vec(ir.HalfType(), n))
        return builder.fpext(halves, _vec(_F32, n))
    w = builder.sext(_load(builder, ptr, _vec(_I16, n)), _vec(_I32, n))
    w = builder.shl(w, _i32_lanes(F16_SHIFT, n))
    w = builder.and_(w, _i32_lanes(F16_MASK, n))
    rebias = _splat(builder, ir.Constant(_F32, F16_REBIAS), n)
    return builder.fmul(builder.bitcast(w, _vec(_F32, n)), rebias)


# fma_tile's element types of b -> their IR types (see _f32_lanes)
_TILE_B = {types.float32: _F32, types.uint16: _I16, types.int8: _I8}


@intrinsic
def fma_tile(
    typingctx, rows, cols, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints
):
    """For r < rows (a literal, 1 to 8), with c_r, a_r the r-th of the offsets c_rows, a_rows
    (8-tuples: the ones past `rows` are not read), and column tiles j < cols (a literal, 1 or 2)
    of 16 columns each:
    c[c_r + 16 j : ... + 16] (+)= sum over k < depth of a[a_r + k] times
    b[b_at + j * b_next + k * b_step : ... + 16], one fused multiply-add per k, in order of k,
    starting from c's values where add (a literal bool) is true, from 0 otherwise. b_next is 16
    where b's column tiles are adjacent; two blocks of keys far apart in a cache take one tile.
    hints: None, or (h, first, second, split), an array and offsets in it: step k also
    prefetches (see prefetch) line k (LINE bytes) of h from first for k < split, else line
    k - split from second; a later block's lines, a few at a time rather than in one burst.

    A rows x w register tile (a vector accumulator per row and 16 columns, no horizontal sums):
    each output lane is its own chain, so its bits depend neither on the other rows and columns
    nor on how many there are. c, a: float32 arrays, b: float32, float16 bits (uint16, widened
    in registers) or int8 (converted in registers); offsets in elements of the flattened
    (C-contiguous) arrays."""
    for literal, most in ((rows, MAX_TILE_ROWS), (cols, 2)):
        if not isinstance(literal, types.IntegerLiteral) or not 1 <= literal.literal_value <= most:
            return None
    if not isinstance(add, types.BooleanLiteral) or b.dtype not in _TILE_B:
        return None
    n_rows, n_cols = rows.literal_value, cols.literal_value

    def codegen(context, builder, sig, args):
        _, _, _, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints = args
        c_offs = [builder.extract_value(c_rows, r) for r in range(n_rows)]
        a_offs = [builder.extract_value(a_rows, r) for r in range(n_rows)]
        vec = _vec(_F32, TILE_COLS)
        fma = _vector_fma(builder, TILE_COLS)
        c_data = context.make_array(sig.args[3])(context, builder, c).data
        a_data = context.make_array(sig.args[5])(context, builder, a).data
        b_data = context.make_array(sig.args[7])(context, builder, b).data
        elem = _TILE_B[sig.args[7].dtype]
        b_cols = [ir.Constant(b_at.type, 0), b_next][:n_cols]
        c_cols = [ir.Constant(b_at.type, j * TILE_COLS) for j in range(n_cols)]
        c_ptrs = [builder.gep(c_data, [builder.add(c_r, j)]) for c_r in c_offs for j in c_cols]
        zero = ir.Constant(vec, [0.0] * TILE_COLS)
        start = [_load(builder, p, vec) if add.literal_value else zero for p in c_ptrs]
        k, accs, close = counted_loop(builder, "tile", ir.Constant(depth.type, 0), depth, start)
        b_row = builder.add(b_at, builder.mul(k, b_step))
        lanes = [
            _f32_lanes(builder, builder.gep(b_data, [builder.add(b_row, j)]), elem) for j in b_cols
        ]
        if hinted:
            fields = [builder.extract_value(hints, j) for j in range(4)]
            first, second, split = (
                context.cast(builder, v, t, types.intp)
                for v, t in zip(fields[1:], sig.args[12][1:], strict=True)
            )
            h_data = context.make_array(sig.args[12][0])(context, builder, fields[0]).data
            line = ir.Constant(k.type, LINE // context.get_abi_sizeof(h_data.type.pointee))
            in_first = builder.icmp_signed("<", k, split)
            line_k = builder.select(in_first, k, builder.sub(k, split))
            at = builder.add(builder.select(in_first, first, second), builder.mul(line_k, line))
            _hint(builder, builder.gep(h_data, [at]))
        new = []
        for r, a_r in enumerate(a_offs):
            x = _splat(builder, builder.load(builder.gep(a_data, [builder.add(a_r, k)])), TILE_COLS)
            for j in range(n_cols):
                new.append(builder.call(fma, [x, lanes[j], accs[r * n_cols + j]]))
        close(new)
        for p, acc in zip(c_ptrs, accs, strict=True):
            builder.store(acc, builder.bitcast(p, vec.as_pointer()), align=4)
        return context.get_dummy_value()

    i, offsets = types.intp, types.UniTuple(types.intp, MAX_TILE_ROWS)
    hinted = not isinstance(hints, types.NoneType)
    if hinted and not (
        isinstance(hints, types.BaseTuple)
        and len(hints) == 4
        and isinstance(hints[0], types.Array)
        and all(isinstance(t, types.Integer) for t in hints[1:])
    ):
        return None
    return types.void(rows, cols, add, c, offsets, a, offsets, b, i, i, i, i, hints), codegen
