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
TARGETS = {
    "x86_64-unknown-linux-gnu": ("x86-64-v3", r"vpmaddwd"),
    "aarch64-unknown-linux-gnu": ("generic", r"smull2?"),
    "arm64-apple-macosx": ("apple-m1", r"smull2?(\.4s)?"),
}


def block_dots_module() -> ir.Module:
    """One function doing what dot_u4, dot_bits and prefetch do to a block, on raw pointers."""
    mod = ir.Module("simd_probe")
    p8 = I8.as_pointer()
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [p8, p8, F32.as_pointer(), F32]), "dots")
    w, x, acc, scale = fn.args
    b = ir.IRBuilder(fn.append_basic_block())
    xv = b.load(b.bitcast(x, simd._vec(I16, 32).as_pointer()), align=1)
    nibbles = simd._pair_sums(b, simd._nibbles(b, w), xv)
    fields = simd._pair_sums(b, simd._bits(b, w, ir.Constant(I8, 4), ir.Constant(I8, 15)), xv)
    lanes = [simd._pick(b, nibbles, range(8)), simd._pick(b, fields, range(8, 16))]
    acc_ptr = b.bitcast(acc, simd._vec(F32, simd.LANES).as_pointer())
    total = b.load(acc_ptr, align=4)
    for lane in lanes:
        total = b.fadd(total, simd._scaled(b, lane, scale))
    b.store(total, acc_ptr, align=4)
    prefetch = mod.declare_intrinsic(
        "llvm.prefetch", [p8], ir.FunctionType(ir.VoidType(), [p8, I32, I32, I32])
    )
    b.call(prefetch, [w, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
    b.ret_void()
    return mod


@pytest.mark.parametrize("triple", list(TARGETS))
def test_block_dot_products_lower_to_multiply_add_pairs_on_every_target(triple):
    for init in ("initialize_all_targets", "initialize_all_asmprinters"):
        getattr(llvm, init, lambda: None)()
    try:
        target = llvm.Target.from_triple(triple)
    except RuntimeError:
        pytest.skip(f"this llvmlite has no backend for {triple}")
    cpu, multiply_add = TARGETS[triple]
    machine = target.create_target_machine(cpu=cpu, opt=3)
    module = llvm.parse_assembly(str(block_dots_module()))
    module.triple = triple
    module.data_layout = str(machine.target_data)
    module.verify()
    ops = re.findall(r"^\s+([a-z][a-z0-9.]*)", machine.emit_assembly(module), re.M)
    assert any(re.fullmatch(multiply_add, op) for op in ops), sorted(set(ops))
    assert not any(op in ("call", "callq", "bl", "blr") for op in ops)  # no library fallback
    assert any(op.startswith(("prefetch", "prfm")) for op in ops)
