"""Float and legacy-quant kernels (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): dequantization
bit-exact with gguf.quants.dequantize, matmul within NMSE 5e-4 of a float64 reference."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_kernels_api import check_row_tile_matmul

from edgeinfer import kernels
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.kernels import simd

# the package re-exports the function `matmul` under the module's name
matmul_module = importlib.import_module("edgeinfer.kernels.matmul")

T = GGMLQuantizationType
TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# Byte offsets of the float16 scale/min fields inside a block.
HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,)}
SPECIAL_HALVES = np.array(
    [
        0x0000,
        0x8000,
        0x0001,
        0x83FF,
        0x0400,
        0x7BFF,
        0xFBFF,
        0x7C00,
        0xFC00,
        0x7E00,
        0x7C01,
        0xFFFF,
    ],
    np.uint16,
)


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical, except that any NaN equals any NaN (payload propagation through a multiply
    is the CPU's business, not the dequantizer's)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.shape != b.shape:
        return False
    na, nb = np.isnan(a), np.isnan(b)
    return bool(
        np.array_equal(na, nb) and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32))
    )


def random_blocks(qtype, n_blocks, rng, special=False) -> np.ndarray:
    """uint8[n_blocks * type_size]: random bytes; scales realistic, or drawn from special halves."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == T.F32:
        if not special:
            raw = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(-1, 4)
    elif qtype in (T.F16, T.BF16):
        if not special:
            x = rng.standard_normal(n_blocks).astype(np.float32)
            x = (
                x.astype(np.float16)
                if qtype == T.F16
                else (x.view(np.uint32) >> 16).astype(np.uint16)
            )
            raw = x.view(np.uint8).reshape(-1, 2)
    else:
        for off in HALF_FIELDS[qtype]:
            if special:
                h = rng.choice(SPECIAL_HALVES, n_blocks)
            else:
                h = (rng.standard_normal(n_blocks) * 0.02).astype(np.float16).view(np.uint16)
            raw[:, off : off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("special", [False, True], ids=["normal", "special"])
def test_dequantize_random_blocks_bit_exact(qtype, special):
    rng = np.random.default_rng(int(qtype) * 2 + special)
    block, _ = GGML_QUANT_SIZES[qtype]
    shape = (7, 64 * block) if block > 1 else (7, 640)
    n_blocks = shape[0] * shape[1] // block
    data = random_blocks(qtype, n_blocks, rng, special)
    got = kernels.dequantize(data, qtype, shape)
    want = gguf_dequantize(data, qtype).reshape(shape)
    assert got.shape == shape and got.dtype == np.float32
    assert same_floats(got, want)


def test_float_types_cover_every_16_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
    for qtype in (T.F16, T.BF16):
        got = kernels.dequantize(bits, qtype, (1 << 16,))
        assert same_floats(got, gguf_dequantize(bits, qtype)), qtype.name


def dequant_all_tensors(path) -> int:
    g = read_gguf(path)
    checked = 0
    try:
        for info in g.tensors.values():
            if info.qtype not in TYPES:
                continue
            data = g.tensor_data(info.name)
            got = kernels.dequantize(data, info.qtype, info.shape)
            want = gguf_dequantize(np.asarray(data), info.qtype).reshape(info.shape)
            assert same_floats(got, want), info.name
            checked += 1
    finally:
        g.close()
    return checked


@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"])
def test_dequantize_synthetic_model_tensors(synthetic_model, ftype):
    assert dequant_all_tensors(synthetic_model("llama", ftype)) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_dequantize_real_model_tensors(real_model, name):
    assert dequant_all_tensors(real_model(name)) > 0


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(((got - want) ** 2).sum() / (want**2).sum())


def check_matmul(qtype, out_dim, in_dim, ns, rng):
    block, _ = GGML_QUANT_SIZES[qtype]
    data = random_blocks(qtype, out_dim * in_dim // block, rng)
    w = kernels.QuantWeight.from_raw(data, qtype, (out_dim, in_dim))
    wf = gguf_dequantize(data, qtype).reshape(out_dim, in_dim).astype(np.float64)
    for n in ns:
        x = rng.standard_normal((n, in_dim)).astype(np.float32)
        y = kernels.matmul(x, w)
        assert y.shape == (n, out_dim) and y.dtype == np.float32
        err = nmse(y, x.astype(np.float64) @ wf.T)
        assert err <= 5e-4, f"{qtype.name} n={n} out={out_dim} in={in_dim}: NMSE {err:.2e}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_accuracy(qtype):
    rng = np.random.default_rng(int(qtype))
    check_matmul(qtype, 301, 1536, (1, 3, 7, 17, 33, 130), rng)
    check_matmul(qtype, 67, 4608, (1, 7), rng)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_tile_matmul(qtype):
    # at in = 576, 301 rows = 10 tiles of 30 + 1, and 6 rows: less than one tile, one group of
    # 5 rows and one of 1; check_row_tile_matmul's 192-row call crosses blocks of 56 activation
    # rows
    rng = np.random.default_rng(int(qtype) + 17)
    block, _ = GGML_QUANT_SIZES[qtype]
    for out_dim in (301, 6):
        data = random_blocks(qtype, out_dim * 576 // block, rng)
        check_row_tile_matmul(data, qtype, out_dim, 576, rng)


@pytest.mark.parametrize("qtype", (T.F32, T.F16, T.BF16), ids=lambda t: t.name)
def test_row_tile_matmul_ragged_input(qtype):
    # a float weight's row can be any length: in = 100 ends in a partial vector of 4 lanes
    # (simd.dot_tile's zero-padded last step), 7 rows in a group of 5 and one of 2
    rng = np.random.default_rng(int(qtype) + 29)
    data = random_blocks(qtype, 7 * 100, rng)
    check_row_tile_matmul(data, qtype, 7, 100, rng)


NARROW_SHAPE_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
import test_kernels_legacy as t
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


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_tiled_path_crosses_tiles(qtype, monkeypatch):
    # A small tile forces several dequantize+BLAS passes, including a short last one.
    monkeypatch.setattr(matmul_module, "TILE_BYTES", 64 * 1024)
    check_matmul(qtype, 1001, 512, (130,), np.random.default_rng(5))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_matches_dequantized_rows(qtype):
    rng = np.random.default_rng(11)
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, cols = 50, 4 * max(block, 32)
    data = random_blocks(qtype, rows * cols // block, rng)
    w = kernels.QuantWeight.from_raw(data, qtype, (rows, cols))
    ids = np.array([3, 0, 49, 3, 17])
    full = gguf_dequantize(data, qtype).reshape(rows, cols)
    assert same_floats(kernels.embedding(w, ids), full[ids])
