"""K-quant kernels (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): dequantization bit-exact with
gguf.quants.dequantize, fused small-n matmul within NMSE 5e-4 of a float64 reference."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_kernels_api import check_row_tile_matmul

from edgeinfer import kernels
from edgeinfer.gguf.reader import read_gguf

T = GGMLQuantizationType
TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
# Byte offsets of the float16 d / dmin fields inside a 256-weight super-block.
HALF_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# zero, -0, subnormals, smallest normal, largest finite, +-inf, NaNs
SPECIAL_HALVES = np.array(
    [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01],
    np.uint16,
)


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical, except that any NaN equals any NaN."""
    a, b = a.reshape(-1), b.reshape(-1)
    na, nb = np.isnan(a), np.isnan(b)
    return bool(
        a.shape == b.shape
        and np.array_equal(na, nb)
        and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32))
    )


def random_blocks(qtype, n_blocks, rng, special=False) -> np.ndarray:
    """uint8[n_blocks * type_size]: random quants and packed scales (every bit pattern, so odd
    6-bit scale/min combinations and negative Q6_K scales occur), d/dmin realistic or special."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        if special:
            h = rng.choice(SPECIAL_HALVES, n_blocks)
        else:
            h = (rng.standard_normal(n_blocks) * 0.002).astype(np.float16).view(np.uint16)
        raw[:, off : off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf * 0 in the reference
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("special", [False, True], ids=["normal", "special"])
def test_dequantize_random_blocks_bit_exact(qtype, special):
    rng = np.random.default_rng(int(qtype) * 2 + special)
    shape = (7, 12 * 256)
    data = random_blocks(qtype, shape[0] * shape[1] // 256, rng, special)
    got = kernels.dequantize(data, qtype, shape)
    assert got.shape == shape and got.dtype == np.float32
    assert same_floats(got, gguf_dequantize(data, qtype).reshape(shape))


def dequant_kquant_tensors(path, row_chunk=4096) -> set:
    """Compares every K-quant tensor of a GGUF file (row chunks bound the memory); returns the
    types seen."""
    g = read_gguf(path)
    seen = set()
    try:
        for info in g.tensors.values():
            if info.qtype not in TYPES:
                continue
            data = np.asarray(g.tensor_data(info.name))
            cols = info.shape[-1]
            rows = info.n_elements // cols
            raw = data.reshape(rows, -1)
            for r0 in range(0, rows, row_chunk):
                part = raw[r0 : r0 + row_chunk]
                got = kernels.dequantize(part.reshape(-1), info.qtype, (part.shape[0], cols))
                want = gguf_dequantize(part, info.qtype)
                assert same_floats(got, want), f"{info.name} rows {r0}.."
            seen.add(info.qtype)
    finally:
        g.close()
    return seen


@pytest.mark.parametrize(
    "ftype, types",
    [
        ("Q2_K", {T.Q2_K}),
        ("Q3_K_M", {T.Q3_K}),
        ("Q4_K_M", {T.Q4_K, T.Q6_K}),
        ("Q5_K_M", {T.Q5_K, T.Q6_K}),
        ("Q6_K", {T.Q6_K}),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dequantize_synthetic_model_tensors(synthetic_model, arch, ftype, types):
    assert types <= dequant_kquant_tensors(synthetic_model(arch, ftype))


@pytest.mark.slow
def test_dequantize_real_gemma_tensors(real_model):
    assert {T.Q4_K, T.Q6_K} <= dequant_kquant_tensors(real_model("gemma3-270m"))


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(((got - want) ** 2).sum() / (want**2).sum())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_dim, in_dim", [(301, 1536), (67, 4608)])
def test_matmul_accuracy(qtype, out_dim, in_dim):
    rng = np.random.default_rng(int(qtype) + in_dim)
    data = random_blocks(qtype, out_dim * in_dim // 256, rng)
    w = kernels.QuantWeight.from_raw(data, qtype, (out_dim, in_dim))
    assert w.extra_nbytes <= 16  # scales are read from the file's bytes; only a part table
    wf = gguf_dequantize(data, qtype).reshape(out_dim, in_dim).astype(np.float64)
    for n in (1, 3, 7, 17, 33):
        x = rng.standard_normal((n, in_dim)).astype(np.float32)
        want = x.astype(np.float64) @ wf.T
        y = kernels.matmul(x, w)  # dispatch: fused kernel for small n, tiles + BLAS beyond
        assert y.shape == (n, out_dim) and y.dtype == np.float32
        small = np.empty((n, out_dim), np.float32)
        w.unit.matmul_small(w.packed, x, small)  # the fused kernel at every n
        for path, got in (("dispatch", y), ("fused", small)):
            err = nmse(got, want)
            assert err <= 5e-4, f"{qtype.name} {path} n={n} {out_dim}x{in_dim}: NMSE {err:.2e}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_tile_matmul(qtype):
    # 301 rows = 37 tiles of 8 + 5, and 6 rows: less than one tile of 4 x 2 blocks
    rng = np.random.default_rng(int(qtype) + 17)
    for out_dim in (301, 6):
        check_row_tile_matmul(
            random_blocks(qtype, out_dim * 512 // 256, rng), qtype, out_dim, 512, rng
        )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_rows_are_independent_of_threads(qtype):
    # prange chunks over output rows: 1 or more threads must give the same bits
    rng = np.random.default_rng(3)
    data = random_blocks(qtype, 37 * 512 // 256, rng)
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
