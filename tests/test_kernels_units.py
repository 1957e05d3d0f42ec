"""Every unit's kernels (F32, F16, BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K): dequantization bit-exact
with gguf.quants.dequantize, matmul within NMSE 5e-4 of a float64 reference, and the row-wise
kernels' bits independent of n and of the threads."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from kernel_checks import (
    FLOATS,
    KQUANTS,
    TYPES,
    T,
    check_matmul,
    check_row_tile_matmul,
    random_blocks,
    same_floats,
)
from numba import njit

from edgeinfer import kernels
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.kernels import kquant_dot, kquants, simd
from edgeinfer.kernels.act_quant import quantize_rows
from edgeinfer.kernels.floatbits import HALF_TABLE, opaque_one

# the package re-exports the function `matmul` under the module's name
matmul_module = importlib.import_module("edgeinfer.kernels.matmul")

by_name = pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)


def row_length(qtype, floats: int, blocks: int) -> int:
    """A row of `blocks` blocks, or of `floats` elements for a float type."""
    block, _ = GGML_QUANT_SIZES[qtype]
    return floats if block == 1 else blocks * block


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf * 0 in the reference
@by_name
@pytest.mark.parametrize("special", [False, True], ids=["normal", "special"])
def test_dequantize_random_blocks_bit_exact(qtype, special):
    rng = np.random.default_rng(int(qtype) * 2 + special)
    block, _ = GGML_QUANT_SIZES[qtype]
    shape = (7, row_length(qtype, 640, 64 if block == 32 else 12))
    data = random_blocks(qtype, shape[0] * shape[1] // block, rng, special)
    got = kernels.dequantize(data, qtype, shape)
    assert got.shape == shape and got.dtype == np.float32
    assert same_floats(got, gguf_dequantize(data, qtype).reshape(shape))


# gguf's F16 reference casts with numpy, which warns on signalling NaNs where the CPU converts
# (aarch64); the kernels read the bits (floatbits.HALF_TABLE)
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_float_types_cover_every_16_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
    for qtype in (T.F16, T.BF16):
        got = kernels.dequantize(bits, qtype, (1 << 16,))
        assert same_floats(got, gguf_dequantize(bits, qtype)), qtype.name


def dequant_all_tensors(path, row_chunk=4096) -> set:
    """Compares every tensor of a supported type in a GGUF file (row chunks bound the memory);
    returns the types seen."""
    g = read_gguf(path)
    seen = set()
    try:
        for info in g.tensors.values():
            if info.qtype not in TYPES:
                continue
            data = np.asarray(g.tensor_data(info.name))
            cols = info.shape[-1]
            raw = data.reshape(info.n_elements // cols, -1)
            for r0 in range(0, raw.shape[0], row_chunk):
                part = raw[r0 : r0 + row_chunk]
                got = kernels.dequantize(part.reshape(-1), info.qtype, (part.shape[0], cols))
                want = gguf_dequantize(part, info.qtype)
                assert same_floats(got, want), f"{info.name} rows {r0}.."
            seen.add(info.qtype)
    finally:
        g.close()
    return seen


@pytest.mark.parametrize(
    "arch, ftype, types",
    [
        *(
            ("llama", name, {T[name]})
            for name in ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
        ),
        *(
            (arch, ftype, types)
            for arch in ("llama", "gemma3")
            for ftype, types in (
                ("Q2_K", {T.Q2_K}),
                ("Q3_K_M", {T.Q3_K}),
                ("Q4_K_M", {T.Q4_K, T.Q6_K}),
                ("Q5_K_M", {T.Q5_K, T.Q6_K}),
                ("Q6_K", {T.Q6_K}),
            )
        ),
    ],
)
def test_dequantize_synthetic_model_tensors(synthetic_model, arch, ftype, types):
    assert types <= dequant_all_tensors(synthetic_model(arch, ftype))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, types",
    [("smollm2-135m-instruct", {T.Q4_1}), ("gemma3-270m", {T.Q4_K, T.Q6_K})],
)
def test_dequantize_real_model_tensors(real_model, name, types):
    assert types <= dequant_all_tensors(real_model(name))


@by_name
@pytest.mark.parametrize(
    "out_dim, in_dim, ns", [(301, 1536, (1, 3, 7, 17, 33, 130)), (67, 4608, (1, 3, 7, 17, 33))]
)
def test_matmul_accuracy(qtype, out_dim, in_dim, ns):
    check_matmul(qtype, out_dim, in_dim, ns, np.random.default_rng(int(qtype) + in_dim))


@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in FLOATS], ids=lambda t: t.name)
def test_quantized_weights_stay_in_the_file_bytes(qtype):
    block, _ = GGML_QUANT_SIZES[qtype]
    data = random_blocks(qtype, 8 * 1536 // block, np.random.default_rng(1))
    w = kernels.QuantWeight.from_raw(data, qtype, (8, 1536))
    assert w.extra_nbytes <= 16  # scales are read from the file's bytes; only a part table


@by_name
def test_row_tile_matmul(qtype):
    # 301 rows: many tiles and a ragged last one; 6 rows: less than one tile, one group of
    # simd.DOT_ROWS rows or fewer and the rest; check_row_tile_matmul's 192-row call crosses
    # blocks of activation rows. in = 576 is 18 legacy blocks, in = 512 two super-blocks.
    rng = np.random.default_rng(int(qtype) + 17)
    block, _ = GGML_QUANT_SIZES[qtype]
    in_dim = 512 if qtype in KQUANTS else 576
    for out_dim in (301, 6):
        data = random_blocks(qtype, out_dim * in_dim // block, rng)
        check_row_tile_matmul(data, qtype, out_dim, in_dim, rng)


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_row_tile_matmul_ragged_input(qtype):
    # a float weight's row can be any length: in = 100 ends in a partial vector of 4 lanes
    # (simd.dot_tile's zero-padded last step), 7 rows in a group of 5 and one of 2
    rng = np.random.default_rng(int(qtype) + 29)
    data = random_blocks(qtype, 7 * 100, rng)
    check_row_tile_matmul(data, qtype, 7, 100, rng)


NARROW_SHAPE_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
import test_kernels_units as t
from edgeinfer.kernels import simd
assert (simd.VEC_LANES, simd.DOT_ROWS, simd.DOT_COLS) == (8, 5, 2), simd.DOT_ROWS
t.test_row_tile_matmul(t.T.Q4_1)
t.test_row_tile_matmul_ragged_input(t.T.F16)
"""


def test_row_tile_matmul_in_the_shape_of_narrower_machines(tmp_path):
    # simd.dot_tile's shape follows the compile target's vector registers: on a machine with
    # 512-bit ones, compile for 256-bit ones (x86-64-v3, AVX2) in a subprocess and run row-tile
    # tests there too, so that both shapes are checked wherever they can run
    if not simd._wide_vectors():
        pytest.skip("this machine compiles the narrow shape already")
    env = dict(os.environ, NUMBA_CPU_NAME="x86-64-v3", NUMBA_CPU_FEATURES="")
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    here = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", NARROW_SHAPE_RUN, here],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@by_name
def test_matmul_tiled_path_crosses_tiles(qtype, monkeypatch):
    # A small tile forces several dequantize+BLAS passes, including a short last one.
    monkeypatch.setattr(matmul_module, "TILE_BYTES", 64 * 1024)
    check_matmul(qtype, 1001, 512, (130,), np.random.default_rng(5))


@by_name
def test_embedding_matches_dequantized_rows(qtype):
    rng = np.random.default_rng(11)
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, cols = 50, row_length(qtype, 128, 4 if block == 32 else 1)
    data = random_blocks(qtype, rows * cols // block, rng)
    w = kernels.QuantWeight.from_raw(data, qtype, (rows, cols))
    ids = np.array([3, 0, 49, 3, 17])
    full = gguf_dequantize(data, qtype).reshape(rows, cols)
    assert same_floats(kernels.embedding(w, ids), full[ids])


@pytest.mark.parametrize(
    "qtype", [t for t in TYPES if t not in FLOATS], ids=lambda t: t.name
)  # (F32's small-n path is BLAS's, which promises nothing of the kind)
def test_fused_rows_get_their_one_row_bits_at_every_n(qtype):
    # A verify pass (1 + k tokens of one sequence) and a step of a few sequences take the fused
    # kernel: each row must get the bits it gets alone, whether its weight blocks are unpacked
    # for it or shared with the other rows (block_matmul_shared). 37 rows: a ragged last row group;
    # n up to 11: more rows than share one unpacking (SHARED_ROWS).
    rng = np.random.default_rng(int(qtype) + 5)
    block, _ = GGML_QUANT_SIZES[qtype]
    in_dim = 512 if qtype in KQUANTS else 576
    data = random_blocks(qtype, 37 * in_dim // block, rng)
    w = kernels.QuantWeight.from_raw(data, qtype, (37, in_dim))
    x = rng.standard_normal((11, in_dim)).astype(np.float32)
    alone = np.empty((11, 37), np.float32)
    for t in range(11):
        w.unit.matmul_small(w.packed, x[t : t + 1], alone[t : t + 1])
    for n in range(2, 12):
        got = np.empty((n, 37), np.float32)
        w.unit.matmul_small(w.packed, x[:n], got)
        assert np.array_equal(got, alone[:n]), f"{qtype.name} n={n}"


def _super_block_rows(dot):
    # -> run(raw, xq, xd, xs, halves, one, out): out[r] = the 8 lanes that dot leaves for weight
    # row r, 4 rows a call (a jitted loop of its own: dot is made in the test)
    @njit
    def run(raw, xq, xd, xs, halves, one, out):
        acc = np.zeros((4, 8), np.float32)
        sums = np.zeros(4, np.float32)
        row_bytes = raw.shape[0] // out.shape[0]
        block_bytes = row_bytes // xd.shape[0]
        for r in range(0, out.shape[0], 4):
            acc[:] = 0
            for b in range(xd.shape[0]):
                o = r * row_bytes + b * block_bytes
                rows = (o, o + row_bytes, o + 2 * row_bytes, o + 3 * row_bytes)
                dot(acc, sums, raw, *rows, xq, xs, b, xd[b], halves, one)
            out[r : r + 4] = acc

    return run


@pytest.mark.skipif(not simd.VNNI_512, reason="needs AVX-512 VNNI to run both widths")
@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_super_block_dot_same_bits_at_either_vector_width(qtype, monkeypatch):
    # With AVX-512 VNNI a super-block's dot product takes two groups a 512-bit instruction
    # (kquant_dot.SPAN), elsewhere one a 256-bit one, and with GFNI too their fields come out of
    # one bit-matrix instruction each: each lane must get the same integer sums every way, so a
    # model's bits do not depend on which of them a machine has
    rng = np.random.default_rng(int(qtype) + 11)
    rows, in_dim = 8, 1024
    raw = random_blocks(qtype, rows * in_dim // 256, rng).reshape(-1)
    x = rng.standard_normal((1, in_dim)).astype(np.float32)
    xq, xd, xs = quantize_rows(x, 256, kquant_dot.SUM_GROUP, np.int8)
    layout = getattr(kquants, f"{qtype.name}_LAYOUT")
    lanes = []
    for span, gfni in [(1, False), (2, False)] + [(2, True)] * simd.GFNI_512:
        monkeypatch.setattr(kquant_dot, "SPAN", span)
        monkeypatch.setattr(kquant_dot, "GFNI_512", gfni)
        out = np.empty((rows, 8), np.float32)
        run = _super_block_rows(kquant_dot.super_block_dot(layout))
        run(raw, xq[0], xd[0], xs[0], HALF_TABLE, opaque_one(HALF_TABLE), out)
        lanes.append(out)
    for other in lanes[1:]:
        assert np.array_equal(lanes[0].view(np.uint32), other.view(np.uint32))


@pytest.mark.parametrize("qtype", [t for t in TYPES if t != T.F32], ids=lambda t: t.name)
def test_matmul_is_independent_of_threads(qtype):
    # prange chunks over output rows: 1 or more threads must give the same bits (F32's BLAS
    # path promises nothing of the kind; its row-wise path is checked in test_row_tile_matmul)
    rng = np.random.default_rng(3)
    block, _ = GGML_QUANT_SIZES[qtype]
    data = random_blocks(qtype, 37 * 512 // block, rng)
    w = kernels.QuantWeight.from_raw(data, qtype, (37, 512))
    x = rng.standard_normal((3, 512)).astype(np.float32)
    before = kernels.get_threads()
    try:
        kernels.set_threads(1)
        one = kernels.matmul(x, w)
        kernels.set_threads(None)
        many = kernels.matmul(x, w)
    finally:
        kernels.set_threads(before)
    assert np.array_equal(one, many)
