"""The IR that kernels.simd builds stays portable: the same vector code lowers to each target's
multiply-add instructions, with no library call, on x86-64, aarch64 Linux and Apple silicon.
(The kernels' results are tested on the machine running the suite; this checks the targets it
cannot run on.)"""

import re

import llvmlite.binding as llvm
import pytest
from llvmlite import ir

from edgeinfer.kernels import simd

I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
V8_32 = simd._vec(I8, 32)
TARGETS = {
    "x86_64-unknown-linux-gnu": ("x86-64-v3", r"vpmaddwd"),
    "aarch64-unknown-linux-gnu": ("generic", r"smull2?"),
    "arm64-apple-macosx": ("apple-m1", r"smull2?(\.4s)?"),
}


@pytest.fixture(autouse=True)
def portable_ir(monkeypatch):
    # simd takes some instructions only where the compile target (this host) has them: GFNI's
    # bit matrices, a half conversion, x86's multiply-adds by name. The IR lowered here for
    # other targets must not; the tests below that want them set them again.
    for flag in ("GFNI_256", "GFNI_512", "HALF_CONVERT", "X86_MADD"):
        monkeypatch.setattr(simd, flag, False)


def probe(name: str, args: list) -> tuple[ir.Module, list, ir.IRBuilder]:
    """A module of one void function taking args -> (it, the function's arguments, a builder
    at its entry)."""
    mod = ir.Module(f"simd_{name}_probe")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), args), name)
    return mod, fn.args, ir.IRBuilder(fn.append_basic_block())


def block_dots_module() -> ir.Module:
    """One function doing what Q8_0's block dot product (kernels.legacy.block_dot: 16-bit
    products) and prefetch do to a block, on raw pointers."""
    p8 = I8.as_pointer()
    mod, (w, x, acc, scale), b = probe("dots", [p8, p8, F32.as_pointer(), F32])
    xv = b.load(b.bitcast(x, simd._vec(I16, 32).as_pointer()), align=1)
    nibbles = simd._pair_sums(b, simd._nibbles(b, w), xv)
    lanes = [simd._pick(b, nibbles, range(8)), simd._pick(b, nibbles, range(8, 16))]
    acc_ptr = b.bitcast(acc, simd._vec(F32, simd.LANES).as_pointer())
    total = b.load(acc_ptr, align=4)
    for lane in lanes:
        total = b.fadd(total, simd._scaled(b, lane, scale))
    b.store(total, acc_ptr, align=4)
    prefetch = mod.declare_intrinsic(
        "llvm.prefetch", [p8], ir.FunctionType(ir.VoidType(), [p8, I32, I32, I32])
    )
    locality = ir.Constant(I32, simd.PREFETCH_LOCALITY)
    b.call(prefetch, [w, ir.Constant(I32, 0), locality, ir.Constant(I32, 1)])
    b.ret_void()
    return mod


def byte_products_module() -> ir.Module:
    """What kquant_dot.super_block_dot does to a group: 4-bit unsigned fields (a constant mask,
    so the optimizer knows their bounds) times int8 activations, then times an integer scale;
    `one` is the 1 it cannot see, as the kernels pass it (the 4- and 5-bit legacy block dot
    products widen by it the same way)."""
    p8 = I8.as_pointer()
    mod, (w, x, out, one, scale), b = probe("byte_products", [p8, p8, I32.as_pointer(), I8, I16])
    fifteen = simd._splat(b, ir.Constant(I8, 15), 32)
    q = b.and_(b.load(b.bitcast(w, V8_32.as_pointer()), align=1), fifteen)
    xv = b.load(b.bitcast(x, V8_32.as_pointer()), align=1)
    sums = simd._pair_sums(b, simd._byte_pair_sums(b, q, xv, one), simd._splat(b, scale, 16))
    b.store(sums, b.bitcast(out, simd._vec(I32, 8).as_pointer()), align=4)
    b.ret_void()
    return mod


def fifth_bits_module() -> ir.Module:
    """What a 5-bit legacy block's dot product does to it: 5-bit fields from nibbles and a
    32-bit mask of fifth bits, times int8 activations as byte products."""
    p8 = I8.as_pointer()
    mod, (w, hi, x, out, one), b = probe("fifth_bits", [p8, p8, p8, I32.as_pointer(), I8])
    q = simd._fifth_bits(b, w, hi)
    xv = b.load(b.bitcast(x, V8_32.as_pointer()), align=1)
    sums = simd._byte_pair_sums(b, q, xv, one)
    b.store(sums, b.bitcast(out, simd._vec(I16, 16).as_pointer()), align=4)
    b.ret_void()
    return mod


def dequant_module() -> ir.Module:
    """What kernels.legacy.block_dequantizer does to a Q5_1 block (Q8_0's is a part of it):
    5-bit fields from nibbles and a bit mask, to float32 times a scale plus a min."""
    p8 = I8.as_pointer()
    mod, (w, hi, out, d, m), b = probe("dequant", [p8, p8, F32.as_pointer(), F32, F32])
    q = simd._fifth_bits(b, w, hi)
    simd._store_dequantized(b, out, q, ir.Constant(I32, 16), d, m)
    b.ret_void()
    return mod


def nibbles_module(shift: bool) -> ir.Module:
    """4-bit fields widened 8 bytes at a time, to float32 times a scale: what the legacy block
    dequantizer does to a Q4_0 block (16 bytes, an offset, high nibbles shifted down), or
    dequant_u4_pair to a K-quant's two sub-blocks (32 bytes, a min each, high nibbles in
    place)."""
    p8 = I8.as_pointer()
    mod, (w, out, d, m), b = probe("nibbles", [p8, F32.as_pointer(), F32, F32])
    if shift:
        simd._dequant_nibbles(b, w, out, 16, ir.Constant(I32, 8), (d, None), (d, None), True)
    else:
        simd._dequant_nibbles(b, w, out, 32, ir.Constant(I32, 0), (d, m), (m, d), False)
    b.ret_void()
    return mod


def q6_module() -> ir.Module:
    """What dequant_q6_quarters does: 4 + 2-bit fields of 16 positions, four scales."""
    p8 = I8.as_pointer()
    mod, (lo, hi, out, d), b = probe("q6", [p8, p8, F32.as_pointer(), F32])
    simd._q6_quarters(b, lo, hi, [d] * 4, out)
    b.ret_void()
    return mod


def q5_module() -> ir.Module:
    """What dequant_u5_sub does: one sub-block's nibbles at a run-time shift and its 5th bits at
    a run-time bit, times a scale plus a min."""
    p8 = I8.as_pointer()
    mod, (q, h, shift, bit, out, d, m), b = probe(
        "q5", [p8, p8, I32, I32, F32.as_pointer(), F32, F32]
    )
    simd._five_bit_fields(b, q, h, shift, bit, d, m, out)
    b.ret_void()
    return mod


def dot_tile_module(lanes: int) -> ir.Module:
    """What dot_tile does to one product beside its loop, in vectors of `lanes` floats: a fused
    multiply-add of whole vectors, one of a zero-padded partial vector (`count` floats), and the
    fixed-order sum of the lanes (fma by 1)."""
    pf = F32.as_pointer()
    mod, (w, x, out, count), b = probe("dot_tile", [pf, pf, pf, ir.IntType(64)])
    vec = simd._vec(F32, lanes)
    fma = simd._vector_fma(b, lanes)
    whole = [b.load(b.bitcast(p, vec.as_pointer()), align=1) for p in (w, x)]
    acc = b.call(fma, [*whole, ir.Constant(vec, [0.0] * lanes)])
    ends = [
        simd._partial_lanes(b, b.gep(p, [ir.Constant(ir.IntType(64), lanes)]), count, lanes)
        for p in (w, x)
    ]
    acc = b.call(fma, [*ends, acc])
    b.store(simd._lane_sum(b, fma, acc), out)
    b.ret_void()
    return mod


def quad_sums_module() -> ir.Module:
    """simd._byte_quad_sums on 32 unsigned bytes and 32 activations, stored."""
    p8 = I8.as_pointer()
    mod, (w, x, out, one), b = probe("quad_sums", [p8, p8, I32.as_pointer(), I8])
    q = b.load(b.bitcast(w, V8_32.as_pointer()), align=1)
    xv = b.load(b.bitcast(x, V8_32.as_pointer()), align=1)
    start = ir.Constant(simd._vec(I32, 8), [0] * 8)
    sums = simd._byte_quad_sums(b, start, q, xv, one)
    b.store(sums, b.bitcast(out, sums.type.as_pointer()), align=4)
    b.ret_void()
    return mod


def lowered_ops(module_ir: ir.Module, triple: str, optimize: bool, cpu: str = "") -> list[str]:
    """The instruction names of module_ir compiled for triple (after LLVM's -O3 passes, as Numba
    runs them, when optimize)."""
    for init in ("initialize_all_targets", "initialize_all_asmprinters"):
        getattr(llvm, init, lambda: None)()
    try:
        target = llvm.Target.from_triple(triple)
    except RuntimeError:
        pytest.skip(f"this llvmlite has no backend for {triple}")
    machine = target.create_target_machine(cpu=cpu or TARGETS[triple][0], opt=3)
    module = llvm.parse_assembly(str(module_ir))
    module.triple = triple
    module.data_layout = str(machine.target_data)
    module.verify()
    if optimize:
        passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(3))
        passes.getModulePassManager().run(module, passes)
    return re.findall(r"^\s+([a-z][a-z0-9.]*)", machine.emit_assembly(module), re.M)


def no_library_call(ops: list[str]) -> bool:
    return not any(op in ("call", "callq", "bl", "blr") for op in ops)


@pytest.mark.parametrize("triple", list(TARGETS))
def test_block_dot_products_lower_to_multiply_add_pairs_on_every_target(triple):
    ops = lowered_ops(block_dots_module(), triple, optimize=False)
    multiply_add = TARGETS[triple][1]
    assert any(re.fullmatch(multiply_add, op) for op in ops), sorted(set(ops))
    assert no_library_call(ops)
    assert any(op.startswith(("prefetch", "prfm")) for op in ops)


@pytest.mark.parametrize("triple", list(TARGETS))
def test_byte_products_survive_the_optimizer_on_every_target(triple):
    ops = lowered_ops(byte_products_module(), triple, optimize=True)
    assert no_library_call(ops), sorted(set(ops))
    if triple.startswith("x86_64"):
        # the whole sub-block: one byte multiply-add, one 16-bit multiply-add by the scale
        assert ops.count("vpmaddubsw") == 1 and ops.count("vpmaddwd") == 1, ops
    else:
        assert any(re.fullmatch(r"smull2?(\.4s)?", op) for op in ops), sorted(set(ops))


@pytest.mark.parametrize("triple", list(TARGETS))
def test_fifth_bits_unpack_as_whole_vectors_on_every_target(triple):
    ops = lowered_ops(fifth_bits_module(), triple, optimize=True)
    assert no_library_call(ops), sorted(set(ops))
    # no per-lane bit extraction: what a bitcast of the mask to <32 x i1> became on aarch64
    # (32 sbfx, one per lane)
    assert not {"sbfx", "ubfx"} & set(ops), sorted(set(ops))


def assert_straight_dequantization(ops: list[str], lanes: int = 32) -> None:
    assert no_library_call(ops), sorted(set(ops))
    # whole vectors: the lanes in at most lanes / 4 conversions (8 or 4 lanes each; unsigned on
    # ARM where the fields are known non-negative), no per-lane bit extraction (what a bitcast
    # of the 5th-bit mask to <32 x i1> became on aarch64)
    conversions = [op for op in ops if op.startswith(("vcvtdq2ps", "scvtf", "ucvtf"))]
    assert 0 < len(conversions) <= lanes // 4, sorted(set(ops))
    assert not {"sbfx", "ubfx"} & set(ops), sorted(set(ops))


@pytest.mark.parametrize("triple", list(TARGETS))
def test_block_dequantization_is_straight_vector_code_on_every_target(triple):
    assert_straight_dequantization(lowered_ops(dequant_module(), triple, optimize=True))


@pytest.mark.parametrize("shift", [True, False], ids=["q4_0", "k_pair"])
@pytest.mark.parametrize("triple", list(TARGETS))
def test_nibble_dequantization_widens_bytes_as_it_loads_them_on_every_target(triple, shift):
    ops = lowered_ops(nibbles_module(shift), triple, optimize=True)
    assert_straight_dequantization(ops, 32 if shift else 64)
    if triple.startswith("x86_64"):  # each 8 bytes widened to lanes by its load itself
        assert ops.count("vpmovzxbd") == (2 if shift else 4), sorted(set(ops))


@pytest.mark.parametrize("triple", list(TARGETS))
def test_q6_k_dequantization_is_straight_vector_code_on_every_target(triple):
    ops = lowered_ops(q6_module(), triple, optimize=True)
    assert_straight_dequantization(ops, 64)
    if triple.startswith("x86_64"):
        assert ops.count("vpmovzxbd") == 6, sorted(set(ops))


@pytest.mark.parametrize("triple", list(TARGETS))
def test_q5_k_dequantization_is_straight_vector_code_on_every_target(triple):
    ops = lowered_ops(q5_module(), triple, optimize=True)
    assert_straight_dequantization(ops)
    if triple.startswith("x86_64"):
        assert ops.count("vpmovzxbd") == 8, sorted(set(ops))


@pytest.mark.parametrize("lanes", sorted({simd.LANES, 16}))
@pytest.mark.parametrize("triple", list(TARGETS))
def test_dot_tile_is_fused_vector_code_on_every_target(triple, lanes):
    # both of dot_tile's widths (simd.VEC_LANES), wherever they are used
    ops = lowered_ops(dot_tile_module(lanes), triple, optimize=True)
    assert no_library_call(ops), sorted(set(ops))
    assert any(op.startswith(("vfmadd", "fmla")) for op in ops), sorted(set(ops))


@pytest.mark.parametrize("vnni", [False, True])
def test_byte_quad_sums_take_one_vnni_instruction_where_the_target_has_it(monkeypatch, vnni):
    # VNNI_256 is the compile target's (simd.target_features); here it is set for each case
    monkeypatch.setattr(simd, "VNNI_256", vnni)
    cpu = "znver4" if vnni else "x86-64-v3"
    ops = lowered_ops(quad_sums_module(), "x86_64-unknown-linux-gnu", optimize=True, cpu=cpu)
    assert no_library_call(ops), sorted(set(ops))
    if vnni:
        assert ops.count("vpdpbusd") == 1 and "vpmaddubsw" not in ops, ops
    else:
        assert ops.count("vpmaddubsw") == 1 and ops.count("vpmaddwd") == 1, ops


@pytest.mark.parametrize("named", [False, True])
def test_byte_products_need_no_or_where_the_multiply_adds_are_named(monkeypatch, named):
    # X86_MADD (AVX2) names vpmaddubsw and vpmaddwd; the portable shape keeps vpmaddubsw only
    # with its fields ORed with an unseen zero, one vpor a group (in a whole Q6_K kernel LLVM
    # still lowered a few groups to widening multiplies). Compiled for AVX2 alone: no VNNI.
    monkeypatch.setattr(simd, "X86_MADD", named)
    monkeypatch.setattr(simd, "VNNI_256", False)
    for module in (byte_products_module(), quad_sums_module()):
        ops = lowered_ops(module, "x86_64-unknown-linux-gnu", optimize=True)
        assert no_library_call(ops), sorted(set(ops))
        assert ops.count("vpmaddubsw") == 1 and ops.count("vpmaddwd") == 1, ops
        assert ("vpor" in ops) != named, ops


def test_nibbles_take_one_bit_matrix_instruction_where_the_target_has_gfni(monkeypatch):
    monkeypatch.setattr(simd, "GFNI_256", True)
    ops = lowered_ops(block_dots_module(), "x86_64-unknown-linux-gnu", optimize=True, cpu="znver4")
    assert no_library_call(ops), sorted(set(ops))
    assert ops.count("vgf2p8affineqb") == 1, ops


def half_lanes_module() -> ir.Module:
    """simd._f32_lanes on 16 float16 values (fma_tile's widening of a float16 KV cache), stored."""
    mod, (src, out), b = probe("half_lanes", [I16.as_pointer(), F32.as_pointer()])
    lanes = simd._f32_lanes(b, src, I16)
    b.store(lanes, b.bitcast(out, lanes.type.as_pointer()), align=4)
    b.ret_void()
    return mod


@pytest.mark.parametrize("convert", [False, True])
@pytest.mark.parametrize("triple", list(TARGETS))
def test_half_widening_is_vector_code_and_one_conversion_where_the_target_has_one(
    monkeypatch, triple, convert
):
    # HALF_CONVERT holds on x86 with F16C (x86-64-v3 has it) and on every aarch64
    monkeypatch.setattr(simd, "HALF_CONVERT", convert)
    ops = lowered_ops(half_lanes_module(), triple, optimize=True)
    assert no_library_call(ops), sorted(set(ops))
    converts = [op for op in ops if op in ("vcvtph2ps", "fcvtl", "fcvtl2")]
    assert bool(converts) == convert, sorted(set(ops))
