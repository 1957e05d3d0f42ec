"""The int8-activation GEMM for prompt rows, shared by every quantized type: activations rounded
per row to int8 blocks, weights unpacked once per call to 16-bit integers, their products summed
in integers with the targets' 16-bit multiply-add (vpmaddwd on AVX2, vpdpwssd where AVX-512 VNNI
fuses it with the add, smlal on ARM), then scaled once per block in float.

A weight row's block b is, after its type's `unpack` (legacy.block_unpacker,
kquant_dot.super_block_unpacker): 16-bit integers wq (offsets subtracted, a K-quant's integer
sub-block scales multiplied in), one float scale sw[b] and, for the types with minimums,
MIN_GROUPS float minimums fm[b, g] (already times their float scale). An activation row's block
b is int8 values xq (held as int16), one float scale dx[b] (max |x| / 127), and for those types
the sums per minimum's group times dx[b], sx[b, g]. Then

    y = sum over b of  (sum of wq * xq) * dx[b] * sw[b]  +  sum over g of fm[b, g] * sx[b, g]

the integer part exact. The block is the type's: 32 for the legacy types (llama.cpp's q8_0
activations), 256 for K-quants (q8_K: one activation scale per super-block, so a K-quant's
integer sub-block scales stay integers). Every output is its own chain of the same operations
whatever tile computes it, and each activation row is rounded on its own: a row's bits depend
neither on the other rows, nor on n, nor on the threads (the row-wise contract).
"""

import re

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import config, njit, prange, types
from numba.extending import intrinsic

from .act_quant import _quantize_block
from .block_matmul import LINE, PartsKernel, row_offset
from .simd import (
    _F32,
    _I16,
    _I32,
    LANES,
    VEC_LANES,
    _lane_sum,
    _pair_sums,
    _pick,
    _ptr,
    _splat,
    _vec,
    _vector_fma,
    counted_loop,
    prefetch,
    target_features,
)


def _wide_int16_madd() -> bool:
    # Whether the compile target (Numba's: NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else the host)
    # lowers 16 int16 pair sums to one multiply-add on 256-bit vectors or wider: x86's vpmaddwd
    # on ymm (AVX2) or zmm (AVX-512). Asked of LLVM itself, for a CPU named without features too.
    mod = ir.Module("int16_madd_probe")
    v16 = _vec(_I16, 16).as_pointer()
    fn = ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [v16, v16, _vec(_I32, 8).as_pointer()]), "f"
    )
    w, x, out = fn.args
    builder = ir.IRBuilder(fn.append_basic_block())
    builder.store(_pair_sums(builder, builder.load(w), builder.load(x)), out)
    builder.ret_void()
    features = config.CPU_FEATURES
    if features is None:
        features = ",".join(sorted(target_features()))
    target = llvm.Target.from_triple(llvm.get_process_triple())
    machine = target.create_target_machine(
        cpu=config.CPU_NAME or llvm.get_host_cpu_name(), features=features, opt=2
    )
    parsed = llvm.parse_assembly(str(mod))
    asm = machine.emit_assembly(parsed)
    return re.search(r"vpmaddwd\s[^\n]*%[yz]mm", asm) is not None


# Whether prompt rows take the GEMM: where the target multiplies 16-bit integers in 256-bit
# vectors or wider; there it beats the float row tiles (Q4_K 1.5x, Q8_0 1.0-1.4x a core on Zen
# 3's AVX2). Elsewhere (aarch64's 128-bit vectors: unmeasured) they stay on the float path.
ENABLED = _wide_int16_madd()

# Largest tile of products: INT_ROWS weight rows by INT_COLS activation rows, their integer sums
# plus a vector per activation row held in registers (16 on AVX2, 32 on AVX-512). 32-value
# blocks scale every block's sums in float, and take SMALL_ROWS rows: 3 x 3 spills there on AVX2
# (Q8_0 at 48 GOPS a core, 65 for 2 x 3, against 90 for K-quants' 3 x 3).
INT_ROWS, INT_COLS = (4, 4) if VEC_LANES == 16 else (3, 3)
SMALL_ROWS = 4 if VEC_LANES == 16 else 2
# Weight rows unpacked per prange item (a multiple of every tile's rows): their CHUNK values of k
# at a time (TILE_ROWS * CHUNK * 2 bytes) stay in L2 while every activation row passes over them.
TILE_ROWS = 60
CHUNK = 1024
PREFETCH_ROWS_AHEAD = 8
STEP = 2 * VEC_LANES  # int16 values per multiply-add: one vector register


def _load_vec(builder, ptr, t, n):
    # n elements of type t at ptr (aligned to an element)
    align = 4 if t == _F32 else t.width // 8
    return builder.load(builder.bitcast(ptr, _vec(t, n).as_pointer()), align=align)


def _fold_to_lanes(builder, v):
    # <VEC_LANES x i32> -> <LANES x i32>, halves added (exact: integers)
    while v.type.count > LANES:
        half = v.type.count // 2
        v = builder.add(_pick(builder, v, range(half)), _pick(builder, v, range(half, 2 * half)))
    return v


@intrinsic
def int_tile(typingctx, rows, cols, block, min_groups, wq, xq, k, sw, dx, fm, sx, at, out):
    """For r < rows, c < cols (literals, 1 to INT_ROWS / INT_COLS), with the offsets
    at = (w row, x row, out, out step) in rows of wq / xq ([*, k] int16, flattened) and elements
    of out:
    out[out + r + c * step] = the module docstring's y of weight row w + r and activation row
    x + c over k // block blocks (block, min_groups: literals; sw, dx: [*, k // block], fm, sx:
    [*, k // block * min_groups] float32, flattened, the same rows)."""
    lits = (rows, cols, block, min_groups)
    if not all(isinstance(v, types.IntegerLiteral) for v in lits):
        return None
    n_rows, n_cols, blk, groups = (v.literal_value for v in lits)
    if not (1 <= n_rows <= INT_ROWS and 1 <= n_cols <= INT_COLS and blk % STEP == 0):
        return None
    if groups not in (0, 1) and groups % LANES:
        return None

    def codegen(context, builder, sig, args):
        wq, xq, k, sw, dx, fm, sx, at, out = args[4:]
        w_row, x_row, out_at, out_step, b_lo, b_hi = (
            builder.extract_value(at, i) for i in range(6)
        )
        arr = dict(wq=4, xq=5, sw=7, dx=8, fm=9, sx=10, out=12)  # their places in sig.args

        def base(name, value, row, width):
            # a pointer to row `row` of the flattened [*, width] array `name`
            return _ptr(context, builder, sig.args[arr[name]], value, builder.mul(row, width))

        nb = builder.sdiv(k, ir.Constant(k.type, blk))
        span = ir.Constant(k.type, groups)
        pairs = [(r, c) for r in range(n_rows) for c in range(n_cols)]
        w0 = [base("wq", wq, builder.add(w_row, ir.Constant(k.type, r)), k) for r in range(n_rows)]
        x0 = [base("xq", xq, builder.add(x_row, ir.Constant(k.type, c)), k) for c in range(n_cols)]
        sw0 = [
            base("sw", sw, builder.add(w_row, ir.Constant(k.type, r)), nb) for r in range(n_rows)
        ]
        dx0 = [
            base("dx", dx, builder.add(x_row, ir.Constant(k.type, c)), nb) for c in range(n_cols)
        ]
        if groups:
            g_w = builder.mul(nb, span)
            fm0 = [
                base("fm", fm, builder.add(w_row, ir.Constant(k.type, r)), g_w)
                for r in range(n_rows)
            ]
            sx0 = [
                base("sx", sx, builder.add(x_row, ir.Constant(k.type, c)), g_w)
                for c in range(n_cols)
            ]
        fvec = _vec(_F32, LANES)
        fma = _vector_fma(builder, LANES)
        zero = ir.Constant(fvec, [0.0] * LANES)
        b, accs, close = counted_loop(builder, "int", b_lo, b_hi, [zero] * len(pairs))
        first = builder.mul(b, ir.Constant(k.type, blk))
        sums = _block_sums(builder, w0, x0, first, blk)
        x_scales = [_splat(builder, builder.load(builder.gep(p, [b])), LANES) for p in dx0]
        w_scales = [_splat(builder, builder.load(builder.gep(p, [b])), LANES) for p in sw0]
        new = []
        for (r, c), acc in zip(pairs, accs, strict=True):
            v = builder.sitofp(_fold_to_lanes(builder, sums[r][c]), fvec)
            v = builder.fmul(v, x_scales[c])
            new.append(builder.call(fma, [v, w_scales[r], acc]))
        if groups:
            g0 = builder.mul(b, span)
            new = _add_minimums(builder, fma, new, pairs, fm0, sx0, g0, groups)
        close(new)
        out_type = sig.args[12]
        later = builder.icmp_signed(">", b_lo, ir.Constant(b_lo.type, 0))
        for (r, c), acc in zip(pairs, accs, strict=True):
            col = builder.mul(ir.Constant(out_at.type, c), out_step)
            o = builder.add(out_at, builder.add(ir.Constant(out_at.type, r), col))
            ptr = _ptr(context, builder, out_type, out, o)
            total = _lane_sum(builder, fma, acc)
            builder.store(builder.select(later, builder.fadd(builder.load(ptr), total), total), ptr)
        return context.get_dummy_value()

    i = types.intp
    at_type = types.UniTuple(i, 6)
    sig = types.void(rows, cols, block, min_groups, wq, xq, i, sw, dx, fm, sx, at_type, out)
    return sig, codegen


def _step_sums(builder, w0, x0, at, sums):
    # sums[r][c] + the pair sums of STEP products of weight row r and activation row c at `at`
    xs = [_load_vec(builder, builder.gep(p, [at]), _I16, STEP) for p in x0]
    out = []
    for r, p in enumerate(w0):
        wv = _load_vec(builder, builder.gep(p, [at]), _I16, STEP)
        row = [_pair_sums(builder, wv, x) for x in xs]
        out.append(
            row if sums is None else [builder.add(a, v) for a, v in zip(sums[r], row, strict=True)]
        )
    return out


def _block_sums(builder, w0, x0, first, blk):
    # -> [r][c] <VEC_LANES x i32>: the block's products from `first`, summed in integers. A loop
    # over its steps past two: straight-line code would have LLVM load every step's vectors
    # ahead and spill the sums.
    index = first.type
    if blk <= 2 * STEP:
        sums = None
        for s in range(0, blk, STEP):
            sums = _step_sums(builder, w0, x0, builder.add(first, ir.Constant(index, s)), sums)
        return sums
    entry = builder.block
    loop = builder.append_basic_block("int.steps")
    after = builder.append_basic_block("int.summed")
    builder.branch(loop)
    builder.position_at_end(loop)
    s = builder.phi(index)
    zero = ir.Constant(_vec(_I32, VEC_LANES), [0] * VEC_LANES)
    sums = [[builder.phi(zero.type) for _ in x0] for _ in w0]
    new = _step_sums(builder, w0, x0, builder.add(first, s), sums)
    s_next = builder.add(s, ir.Constant(index, STEP))
    builder.cbranch(builder.icmp_signed("<", s_next, ir.Constant(index, blk)), loop, after)
    s.add_incoming(ir.Constant(index, 0), entry)
    s.add_incoming(s_next, loop)
    for row, new_row in zip(sums, new, strict=True):
        for a, v in zip(row, new_row, strict=True):
            a.add_incoming(zero, entry)
            a.add_incoming(v, loop)
    builder.position_at_end(after)
    return new


def _add_minimums(builder, fma, accs, pairs, fm0, sx0, g0, groups):
    # accs[(r, c)] + the block's sum over its groups of fm * sx: in LANES-wide fused multiply-adds
    # (groups a multiple of LANES), or one product into lane 0 (groups = 1)
    if groups == 1:
        fms = [builder.load(builder.gep(p, [g0])) for p in fm0]
        sxs = [builder.load(builder.gep(p, [g0])) for p in sx0]
        zero = ir.Constant(_vec(_F32, LANES), [0.0] * LANES)
        lane0 = ir.Constant(_I32, 0)
        out = []
        for (r, c), acc in zip(pairs, accs, strict=True):
            product = builder.insert_element(zero, builder.fmul(fms[r], sxs[c]), lane0)
            out.append(builder.fadd(acc, product))
        return out
    out = list(accs)
    for g in range(0, groups, LANES):
        at = builder.add(g0, ir.Constant(g0.type, g))
        fms = [_load_vec(builder, builder.gep(p, [at]), _F32, LANES) for p in fm0]
        sxs = [_load_vec(builder, builder.gep(p, [at]), _F32, LANES) for p in sx0]
        out = [
            builder.call(fma, [fms[r], sxs[c], acc]) for (r, c), acc in zip(pairs, out, strict=True)
        ]
    return out


# x: [n, k] -> (xq int16[n, k], dx float32[n, k // block], sx float32[n, k // block * groups]):
# each row rounded on its own (act_quant), sx the sums of xq per block / groups values times dx
@njit(cache=True, inline="always")
def quantize_activations(x, block, groups):
    n, k = x.shape
    nb = k // block
    size = block // groups if groups > 0 else 0
    xq = np.empty((n, k), np.int16)
    dx = np.empty((n, nb), np.float32)
    sums = np.empty((n, nb * groups), np.int32)
    sx = np.empty((n, nb * groups), np.float32)
    for t in prange(n):
        for b in range(nb):
            _quantize_block(x, block, size, xq, dx, sums, t, b)
            for g in range(b * groups, (b + 1) * groups):
                sx[t, g] = dx[t, b] * np.float32(sums[t, g])
    return xq, dx, sx


# unpack(flat u8, off, halves, wq i16[*], wq_at, sw f32[*], sw_at, fm f32[*], fm_at): a type's
# block at flat[off] -> its 16-bit integers at wq[wq_at:][:block], its scale at sw[sw_at], its
# min_groups minimums at fm[fm_at:] (see the module docstring).
# flat, starts, ends: one or more weights' bytes (block_matmul.row_offset: Q, K and V in one
# launch), x: [n, in] -> out: [n, sum of the parts' rows]; a row is in // block blocks of
# block_bytes. Each prange item unpacks TILE_ROWS rows, then takes their products with every
# activation row CHUNK values of k at a time (_products). Inlined into each unit's own kernel
# (units.build).
@njit(cache=True, inline="always")
def int8_matmul(unpack, flat, starts, ends, halves, x, out, block, block_bytes, min_groups, rows):
    n, k = x.shape
    nb = k // block
    xq, dx, sx = quantize_activations(x, block, min_groups)
    acts = (xq.reshape(-1), dx.reshape(-1), sx.reshape(-1))
    last = ends[ends.shape[0] - 1]
    row_bytes = nb * block_bytes
    for g in prange((last + TILE_ROWS - 1) // TILE_ROWS):
        r0 = g * TILE_ROWS
        m = min(TILE_ROWS, last - r0)
        wq = np.empty(m * k, np.int16)
        sw = np.empty(m * nb, np.float32)
        fm = np.empty(m * nb * min_groups, np.float32)
        for i in range(m):
            at = row_offset(starts, ends, r0 + i, row_bytes)
            ahead = row_offset(starts, ends, min(r0 + i + PREFETCH_ROWS_AHEAD, last - 1), row_bytes)
            for line in range(0, row_bytes, LINE):
                prefetch(flat, ahead + line)
            for b in range(nb):
                j = i * nb + b
                unpack(flat, at + b * block_bytes, halves, wq, j * block, sw, j, fm, j * min_groups)
        weights = (wq, sw, fm)
        _products(
            rows, weights, m, acts, n, k, block, min_groups, out.reshape(-1), r0, out.shape[1]
        )


# weights = (wq, sw, fm) of m unpacked rows, acts = (xq, dx, sx) of n activation rows, both
# flattened -> outf[t * step + r0 + r] for every row r and activation row t: int_tile over
# blocks of CHUNK values of k (the first stores, the others add), rows x INT_COLS tiles (rows: a
# literal, tile_rows(block)), ragged edges 1 x 1. Per chunk, an activation tile's
# rows stay in L1 while all m rows pass by.
@njit(cache=True, inline="always")
def _products(rows, weights, m, acts, n, k, block, min_groups, outf, r0, step):
    wq, sw, fm = weights
    xq, dx, sx = acts
    nb = k // block
    chunk = max(1, CHUNK // block)
    full = m - m % rows
    for b0 in range(0, nb, chunk):
        b1 = min(nb, b0 + chunk)
        for t in range(0, n - n % INT_COLS, INT_COLS):
            for i in range(0, full, rows):
                at = (i, t, t * step + r0 + i, step, b0, b1)
                int_tile(rows, INT_COLS, block, min_groups, wq, xq, k, sw, dx, fm, sx, at, outf)
        # the ragged edges one product at a time (one tile shape less to compile)
        for t in range(n):
            first = 0 if t >= n - n % INT_COLS else full
            for i in range(first, m):
                at = (i, t, t * step + r0 + i, step, b0, b1)
                int_tile(1, 1, block, min_groups, wq, xq, k, sw, dx, fm, sx, at, outf)


def tile_rows(block: int) -> int:
    """Weight rows of int8_matmul's tiles for a type's block size."""
    return SMALL_ROWS if block <= 32 else INT_ROWS


class IntGemm(PartsKernel):
    """A unit's `matmul_int8`, from its jitted wrapper of int8_matmul."""
