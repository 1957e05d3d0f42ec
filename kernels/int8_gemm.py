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
from functools import partial
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import config, njit, prange, types
from numba.extending import intrinsic

from .act_quant import _quantize_block
from .block_matmul import PartsKernel, row_offset
from .cache_stamp import remembered
from .simd import (
    _F32,
    _I16,
    _I32,
    LANES,
    LINE,
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


def _emits_wide_int16_madd(cpu: str, features: str) -> bool:
    # Whether LLVM lowers 16 int16 pair sums for this target to one multiply-add on 256-bit
    # vectors or wider: x86's vpmaddwd on ymm (AVX2) or zmm (AVX-512).
    mod = ir.Module("int16_madd_probe")
    v16 = _vec(_I16, 16).as_pointer()
    fn = ir.Function(
        mod, ir.FunctionType(ir.VoidType(), [v16, v16, _vec(_I32, 8).as_pointer()]), "f"
    )
    w, x, out = fn.args
    builder = ir.IRBuilder(fn.append_basic_block())
    builder.store(_pair_sums(builder, builder.load(w), builder.load(x)), out)
    builder.ret_void()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    machine = target.create_target_machine(cpu=cpu, features=features, opt=2)
    asm = machine.emit_assembly(llvm.parse_assembly(str(mod)))
    return re.search(r"vpmaddwd\s[^\n]*%[yz]mm", asm) is not None


def _wide_int16_madd() -> bool:
    # _emits_wide_int16_madd for the compile target (Numba's: NUMBA_CPU_NAME /
    # NUMBA_CPU_FEATURES, else the host), a CPU named without features too. Emitting the
    # assembly takes 7-15 ms of every start, so the answer is kept beside the kernels.
    cpu = config.CPU_NAME or llvm.get_host_cpu_name()
    features = config.CPU_FEATURES
    if features is None:
        features = ",".join(sorted(target_features()))
    key = f"llvmlite {llvmlite.__version__} {llvm.get_process_triple()} {cpu} {features}"
    ask = partial(_emits_wide_int16_madd, cpu, features)
    return remembered(Path(__file__).parent, "int16-madd", key, ask)


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


class TileFrame:
    """What the GEMM tiles' code generation shares (int_tile, byte_gemm.byte_tile: the same
    arguments): pointers to rows of their flattened arrays, the `at` offsets, and the stores of
    the finished sums."""

    # the arrays' places in the tiles' signature, and whose rows they hold
    ARRAYS = dict(wq=4, xq=5, sw=7, dx=8, fm=9, sx=10)
    WEIGHT_ROWS = ("wq", "sw", "fm")

    def __init__(self, context, builder, sig, args):
        self.context, self.builder, self.sig, self.args = context, builder, sig, args
        self.k = args[6]
        at = args[11]
        self.w_row, self.x_row, self.out_at, self.out_step, self.b_lo, self.b_hi = (
            builder.extract_value(at, i) for i in range(6)
        )

    def rows(self, name, count, width):
        """-> pointers to `count` rows of the flattened [*, width] array `name`, from the tile's
        first weight row (wq, sw, fm) or activation row (xq, dx, sx)"""
        builder, i = self.builder, self.ARRAYS[name]
        first = self.w_row if name in self.WEIGHT_ROWS else self.x_row
        return [
            _ptr(
                self.context,
                builder,
                self.sig.args[i],
                self.args[i],
                builder.mul(builder.add(first, ir.Constant(first.type, r)), width),
            )
            for r in range(count)
        ]

    def store(self, fma, pairs, accs):
        """out[out + r + c * step] = the lanes' sum of each (r, c) pair's accumulator, added to
        what is there past the first block"""
        builder, out_at = self.builder, self.out_at
        later = builder.icmp_signed(">", self.b_lo, ir.Constant(self.b_lo.type, 0))
        for (r, c), acc in zip(pairs, accs, strict=True):
            col = builder.mul(ir.Constant(out_at.type, c), self.out_step)
            o = builder.add(out_at, builder.add(ir.Constant(out_at.type, r), col))
            ptr = _ptr(self.context, builder, self.sig.args[12], self.args[12], o)
            total = _lane_sum(builder, fma, acc)
            builder.store(builder.select(later, builder.fadd(builder.load(ptr), total), total), ptr)


def tile_literals(*values):
    """The values of a tile's literal arguments, or None where one is not a literal."""
    if not all(isinstance(v, types.IntegerLiteral) for v in values):
        return None
    return tuple(v.literal_value for v in values)


def tile_signature(rows, cols, block, min_groups, wq, xq, sw, dx, fm, sx, out):
    i = types.intp
    at = types.UniTuple(i, 6)
    return types.void(rows, cols, block, min_groups, wq, xq, i, sw, dx, fm, sx, at, out)


@intrinsic
def int_tile(typingctx, rows, cols, block, min_groups, wq, xq, k, sw, dx, fm, sx, at, out):
    """For r < rows, c < cols (literals, 1 to INT_ROWS / INT_COLS), with the offsets
    at = (w row, x row, out, out step, first block, end block) in rows of wq / xq ([*, k]
    int16, flattened) and elements of out:
    out[out + r + c * step] (+)= the module docstring's y of weight row w + r and activation row
    x + c over those blocks (block, min_groups: literals; sw, dx: [*, k // block], fm, sx:
    [*, k // block * min_groups] float32, flattened, the same rows); block 0 stores, a later
    first block adds to out."""
    lits = tile_literals(rows, cols, block, min_groups)
    if lits is None:
        return None
    n_rows, n_cols, blk, groups = lits
    if not (1 <= n_rows <= INT_ROWS and 1 <= n_cols <= INT_COLS and blk % STEP == 0):
        return None
    if groups not in (0, 1) and groups % LANES:
        return None

    def codegen(context, builder, sig, args):
        frame = TileFrame(context, builder, sig, args)
        k = frame.k
        nb = builder.sdiv(k, ir.Constant(k.type, blk))
        span = ir.Constant(k.type, groups)
        pairs = [(r, c) for r in range(n_rows) for c in range(n_cols)]
        w0, x0 = frame.rows("wq", n_rows, k), frame.rows("xq", n_cols, k)
        sw0, dx0 = frame.rows("sw", n_rows, nb), frame.rows("dx", n_cols, nb)
        if groups:
            g_w = builder.mul(nb, span)
            fm0, sx0 = frame.rows("fm", n_rows, g_w), frame.rows("sx", n_cols, g_w)
        fvec = _vec(_F32, LANES)
        fma = _vector_fma(builder, LANES)
        zero = ir.Constant(fvec, [0.0] * LANES)
        b, accs, close = counted_loop(builder, "int", frame.b_lo, frame.b_hi, [zero] * len(pairs))
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
        frame.store(fma, pairs, accs)
        return context.get_dummy_value()

    return tile_signature(rows, cols, block, min_groups, wq, xq, sw, dx, fm, sx, out), codegen


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
    bits = x.view(np.uint32)
    for t in prange(n):
        for b in range(nb):
            _quantize_block(x, bits, block, size, xq, dx, sums, t, b)
            for g in range(b * groups, (b + 1) * groups):
                sx[t, g] = dx[t, b] * np.float32(sums[t, g])
    return xq, dx, sx


# unpack(flat u8, off, halves, wq i16[*], wq_at, sw f32[*], sw_at, fm f32[*], fm_at): a type's
# block at flat[off] -> its 16-bit integers at wq[wq_at:][:block], its scale at sw[sw_at], its
# min_groups minimums at fm[fm_at:] (see the module docstring).
# flat, starts, ends: one or more weights' bytes (block_matmul.row_offset: Q, K and V in one
# launch), x: [n, in] -> out: [n, sum of the parts' rows]; a row is in // block blocks of
# block_bytes. Each prange item unpacks TILE_ROWS rows, then takes their products with every
# activation row CHUNK values of k at a time (products). Inlined into each unit's own kernel
# (units.build).
@njit(cache=True, inline="always")
def int8_matmul(unpack, flat, starts, ends, halves, x, out, block, block_bytes, min_groups, rows):
    k = x.shape[1]
    acts = quantize_activations(x, block, min_groups)
    last = ends[ends.shape[0] - 1]
    for g in prange((last + TILE_ROWS - 1) // TILE_ROWS):
        r0 = g * TILE_ROWS
        m = min(TILE_ROWS, last - r0)
        layout = (block, block_bytes, 1, min_groups)
        weights = unpack_rows(unpack, flat, starts, ends, halves, r0, m, k, layout, np.int16, k)
        products(int_tile, rows, INT_COLS, weights, m, acts, k, block, min_groups, out, r0)


# -> (wq, sw, fm): rows r0 to r0 + m - 1 of the weights (see int8_matmul) unpacked, stride
# values apart (k, or more: the values past k zeros), their blocks' values wq[m * stride]
# (q_type), scales sw and minimums fm, `scales` and min_groups a block, as many apart (layout =
# (block, block_bytes, scales, min_groups)). The rows PREFETCH_ROWS_AHEAD ahead are hinted
# meanwhile, line by line.
@njit(cache=True, inline="always")
def unpack_rows(unpack, flat, starts, ends, halves, r0, m, k, layout, q_type, stride):
    block, block_bytes, scales, min_groups = layout
    nb = k // block
    last = ends[ends.shape[0] - 1]
    row_bytes = nb * block_bytes
    blocks = m * stride // block
    if stride == k:
        wq = np.empty(m * stride, q_type)
        sw = np.empty(blocks * scales, np.float32)
        fm = np.empty(blocks * min_groups, np.float32)
    else:
        wq = np.zeros(m * stride, q_type)
        sw = np.zeros(blocks * scales, np.float32)
        fm = np.zeros(blocks * min_groups, np.float32)
    for i in range(m):
        at = row_offset(starts, ends, r0 + i, row_bytes)
        ahead = row_offset(starts, ends, min(r0 + i + PREFETCH_ROWS_AHEAD, last - 1), row_bytes)
        for line in range(0, row_bytes, LINE):
            prefetch(flat, ahead + line)
        for b in range(nb):
            wq_at = i * stride + b * block
            j = wq_at // block
            off = at + b * block_bytes
            unpack(flat, off, halves, wq, wq_at, sw, j * scales, fm, j * min_groups)
    return wq, sw, fm


# weights = (wq, sw, fm) of m unpacked rows (flattened), acts = (xq, dx, sx) of the n activation
# rows ([n, *]) -> out[t, r0 + r] for every row r and activation row t: `product` (an intrinsic
# taking int_tile's arguments) over blocks of CHUNK values of k (the first stores, the others
# add) in rows x cols tiles (literals), ragged edges 1 x 1. Per chunk, an activation tile's rows
# stay in L1 while all m rows pass by.
@njit(cache=True, inline="always")
def products(product, rows, cols, weights, m, acts, k, block, min_groups, out, r0):
    wq, sw, fm = weights
    n, step = out.shape
    outf = out.reshape(-1)
    xq, dx, sx = acts
    xq, dx, sx = xq.reshape(-1), dx.reshape(-1), sx.reshape(-1)
    nb = k // block
    chunk = max(1, CHUNK // block)
    full = m - m % rows
    for b0 in range(0, nb, chunk):
        b1 = min(nb, b0 + chunk)
        for t in range(0, n - n % cols, cols):
            for i in range(0, full, rows):
                at = (i, t, t * step + r0 + i, step, b0, b1)
                product(rows, cols, block, min_groups, wq, xq, k, sw, dx, fm, sx, at, outf)
        # the ragged edges one product at a time (one tile shape less to compile)
        for t in range(n):
            first = 0 if t >= n - n % cols else full
            for i in range(first, m):
                at = (i, t, t * step + r0 + i, step, b0, b1)
                product(1, 1, block, min_groups, wq, xq, k, sw, dx, fm, sx, at, outf)


def tile_rows(block: int) -> int:
    """Weight rows of int8_matmul's tiles for a type's block size."""
    return SMALL_ROWS if block <= 32 else INT_ROWS


class IntGemm(PartsKernel):
    """A unit's `matmul_int8`, from its jitted wrapper of int8_matmul."""
