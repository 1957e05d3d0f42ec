"""Helpers for the kernel tests: random blocks of any GGML type, bit-for-bit comparison, and the
checks every unit's matmul kernels must pass."""

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from edgeinfer import kernels

T = GGMLQuantizationType
FLOATS = (T.F32, T.F16, T.BF16)
LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
KQUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
TYPES = FLOATS + LEGACY + KQUANTS
# Byte offsets of the float16 scale / min fields in a block (d, dmin for the K-quants).
HALF_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
# zero, -0, subnormals, smallest normal, largest finite, +-inf, NaNs
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
    """uint8[n_blocks * type_size]: random quants and packed scales (every bit pattern, so odd
    6-bit scale/min combinations and negative Q6_K scales occur); float16 scales realistic, or
    drawn from SPECIAL_HALVES; float types: normal values, or (special) any bits."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype in FLOATS:
        if not special:
            x = rng.standard_normal(n_blocks).astype(np.float32)
            if qtype == T.F16:
                x = x.astype(np.float16)
            elif qtype == T.BF16:
                x = (x.view(np.uint32) >> 16).astype(np.uint16)
            raw = x.view(np.uint8).reshape(n_blocks, type_size)
        return raw.reshape(-1)
    for off in HALF_FIELDS[qtype]:
        if special:
            h = rng.choice(SPECIAL_HALVES, n_blocks)
        else:
            h = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16).view(np.uint16)
        raw[:, off : off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(((got - want) ** 2).sum() / (want**2).sum())


def check_matmul(qtype, out_dim: int, in_dim: int, ns, rng) -> None:
    """kernels.matmul (the path chosen by n) and the unit's small-n kernel (at every n) within
    NMSE 5e-4 of a float64 product with the reference dequantization."""
    block, _ = GGML_QUANT_SIZES[qtype]
    data = random_blocks(qtype, out_dim * in_dim // block, rng)
    w = kernels.QuantWeight.from_raw(data, qtype, (out_dim, in_dim))
    wf = gguf_dequantize(data, qtype).reshape(out_dim, in_dim).astype(np.float64)
    for n in ns:
        x = rng.standard_normal((n, in_dim)).astype(np.float32)
        want = x.astype(np.float64) @ wf.T
        y = kernels.matmul(x, w)
        assert y.shape == (n, out_dim) and y.dtype == np.float32
        paths = [("dispatch", y)]
        if w.unit.matmul_small is not None:
            small = np.empty((n, out_dim), np.float32)
            w.unit.matmul_small(w.packed, x, small)
            paths.append(("small", small))
        for path, got in paths:
            err = nmse(got, want)
            assert err <= 5e-4, f"{qtype.name} {path} n={n} {out_dim}x{in_dim}: NMSE {err:.2e}"


def check_row_tile_matmul(data: np.ndarray, qtype, out_dim: int, in_dim: int, rng) -> None:
    """The batched-decode kernel (`matmul_rows`) of a unit on `data` [out_dim, in_dim]: accurate
    at every n of its range, and a row's bits independent of the other rows, of n and of the
    thread count (what a continuous-batching engine relies on)."""
    w = kernels.QuantWeight.from_raw(data, qtype, (out_dim, in_dim))
    wf = gguf_dequantize(data, qtype).reshape(out_dim, in_dim).astype(np.float64)
    x = rng.standard_normal((w.unit.rows_n_max, in_dim)).astype(np.float32)

    def rows(xs):
        out = np.full((xs.shape[0], out_dim), np.nan, np.float32)
        w.unit.matmul_rows(w.row_parts, np.ascontiguousarray(xs), out)
        return out

    full = rows(x)
    want = x.astype(np.float64) @ wf.T
    err = nmse(full, want)
    assert err <= 5e-4, f"{qtype.name} row tiles {out_dim}x{in_dim}: NMSE {err:.2e}"
    for n in (1, 2, 5, 16, 33):
        assert np.array_equal(rows(x[:n]), full[:n]), f"{qtype.name} n={n}"
    assert np.array_equal(rows(x[7:12]), full[7:12])
    # the engine's path for every row (the row-tile or the fused kernel, per unit): a row's bits
    # whatever shares the call, also past rows_n_max, where the path chosen by n takes BLAS
    many = np.concatenate([x, x[::-1], x])
    row_wise = kernels.matmul(many, w, row_wise=True)
    for lo, hi in ((0, 1), (0, 3), (0, 16), (5, 9), (60, 150)):
        assert np.array_equal(kernels.matmul(many[lo:hi], w, row_wise=True), row_wise[lo:hi])
    # the dispatch for every n the unit routes to the row-tile kernel (the K-quants' int8 GEMM
    # takes those n where the target has one: test_int8_gemm)
    if not kernels.takes_int8_rows(w.unit):
        lo = w.unit.small_n_max + 1 if w.unit.matmul_small is not None else 1
        for n in range(lo, w.unit.rows_n_max + 1, 5):
            assert np.array_equal(kernels.matmul(x[:n], w), full[:n]), f"{qtype.name} n={n}"
    before = kernels.get_threads()
    try:
        kernels.set_threads(1)
        assert np.array_equal(rows(x), full)
        assert np.array_equal(kernels.matmul(many, w, row_wise=True), row_wise)
    finally:
        kernels.set_threads(before)
