"""The int8-activation GEMM (kernels.int8_gemm), the fast path for prompt rows: each type's
result against float64 exact math on the file's dequantized weights times the activations as
the kernel rounds them (llama.cpp's q8 blocks: 32 values for legacy types, 256 for K-quants),
bit for bit where every intermediate value is exact; a row's bits whatever shares the call; and
the choice of path by the compile target."""

import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from kernel_checks import HALF_FIELDS, KQUANTS, LEGACY, T, random_blocks

from edgeinfer import kernels
from edgeinfer.kernels import byte_gemm, int8_gemm
from edgeinfer.kernels.simd import target_features
from edgeinfer.models.base import Linear

QUANTIZED = KQUANTS + LEGACY
# 13 rows: full tiles of 3 (K-quants) and 2 (legacy) rows plus a ragged one; 7 activation rows:
# tiles of 3 plus one; 1280 inputs: five super-blocks, across the GEMM's 1024-value chunks
OUT, IN, N = 13, 1280, 7
needs_int8 = pytest.mark.skipif(not int8_gemm.ENABLED, reason="the target takes the float path")


def rounded(x: np.ndarray, block: int) -> np.ndarray:
    """x: float32[n, k] -> float64[n, k], x rounded as the kernel does: per block of `block`
    values, d = max|x| / 127 (float32), q = rint(x * (1 / d))."""
    n, k = x.shape
    xb = x.reshape(n, k // block, block)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    return (np.rint(xb * inv).astype(np.float64) * d).reshape(n, k)


def int8_gemm_of(data: np.ndarray, qtype, x: np.ndarray, out_dim: int) -> np.ndarray:
    w = kernels.QuantWeight.from_raw(data, qtype, (out_dim, x.shape[1]))
    out = np.full((x.shape[0], out_dim), np.nan, np.float32)
    w.unit.matmul_int8(w.row_parts, x, out)
    return out


@needs_int8
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_int8_gemm_is_exact_math_on_rounded_activations(qtype):
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    x_block = 256 if qtype in KQUANTS else 32
    # Random blocks, x of several scales: only float rounding of scales and sums may differ from
    # exact math (a relative 1e-6 of the sum of |products|; a wrong integer part is off by far more)
    # legacy rows one block past whole 256-value super-blocks: the byte GEMM's padding
    k_in = IN if qtype in KQUANTS else IN + 32
    data = random_blocks(qtype, OUT * k_in // block, rng)
    x = (rng.standard_normal((N, k_in)) * rng.uniform(0.1, 10, (N, 1))).astype(np.float32)
    w = gguf_dequantize(data, qtype).reshape(OUT, k_in).astype(np.float64)
    xr = rounded(x, x_block)
    got = int8_gemm_of(data, qtype, x, OUT)
    bound = np.abs(xr) @ np.abs(w).T
    assert np.all(np.abs(got - xr @ w.T) <= 1e-6 * bound + 1e-30), qtype.name
    # Bit for bit: float16 scales powers of two, x whole numbers whose blocks each reach 127 (so
    # dx = 1 and the rounding is exact), few inputs: every product and sum is a float32 exactly
    # (at most 24 significant bits), the integer part as much as the float one
    k = 256
    data = random_blocks(qtype, OUT * k // block, rng).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    for off in HALF_FIELDS[qtype]:
        data[:, off : off + 2] = np.array([2.0**-6], np.float16).view(np.uint8)
    data = data.reshape(-1)
    xi = rng.integers(-3, 4, (N, k)).astype(np.float32)
    xi[:, ::x_block] = 127
    w = gguf_dequantize(data, qtype).reshape(OUT, k).astype(np.float64)
    want = (xi.astype(np.float64) @ w.T).astype(np.float32)
    assert np.array_equal(int8_gemm_of(data, qtype, xi, OUT), want), qtype.name


@needs_int8
@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q6_K, T.Q8_0), ids=lambda t: t.name)
def test_int8_row_wise_rows_are_independent_of_the_batch(qtype):
    # the row-wise contract: a row's bits are the same alone, in any batch, at any thread count
    rng = np.random.default_rng(7)
    block = GGML_QUANT_SIZES[qtype][0]
    parts = [
        kernels.QuantWeight.from_raw(
            random_blocks(qtype, rows * IN // block, rng), qtype, (rows, IN)
        )
        for rows in (OUT, 5)
    ]
    call = kernels.bind_row_wise(parts, int8=True)
    x = rng.standard_normal((3 * N, IN)).astype(np.float32)
    full = call(x)
    assert full.shape == (3 * N, OUT + 5)
    for lo, hi in ((0, 1), (4, 5), (2, 9), (1, 3 * N)):
        assert np.array_equal(call(x[lo:hi]), full[lo:hi]), (lo, hi)
    before = kernels.get_threads()
    try:
        kernels.set_threads(1)
        assert np.array_equal(call(x), full)
    finally:
        kernels.set_threads(before)
    assert not np.array_equal(full, kernels.bind_row_wise(parts)(x))  # and it is not the float path


def test_targets_without_the_gemm_keep_the_float_path(monkeypatch):
    # a unit's int8 GEMM is only taken where the compile target enables it and it beats the
    # path before it (the K-quants, Q8_0); elsewhere int8=True gives the row-wise kernels' bits
    rng = np.random.default_rng(11)
    assert [t for t in QUANTIZED if kernels.get_unit(t).int8_faster] == [*KQUANTS, T.Q8_0]
    q4 = kernels.QuantWeight.from_raw(random_blocks(T.Q4_0, OUT * 8, rng), T.Q4_0, (OUT, 256))
    x4 = rng.standard_normal((N, 256)).astype(np.float32)
    assert np.array_equal(
        kernels.bind_row_wise([q4], int8=True)(x4), kernels.bind_row_wise([q4])(x4)
    )
    w = kernels.QuantWeight.from_raw(
        random_blocks(T.Q4_K, OUT * 256 // 256, rng), T.Q4_K, (OUT, 256)
    )
    x = rng.standard_normal((N, 256)).astype(np.float32)
    matmul_module = sys.modules["edgeinfer.kernels.matmul"]
    monkeypatch.setattr(matmul_module, "INT8_ENABLED", False)
    assert np.array_equal(kernels.bind_row_wise([w], int8=True)(x), kernels.bind_row_wise([w])(x))


@needs_int8
@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q6_K), ids=lambda t: t.name)
def test_calls_above_the_fused_range_take_the_gemm_for_k_quants(qtype, monkeypatch):
    # small_n_max < n <= rows_n_max rows (a decode step of many sequences): the K-quants' GEMM
    # beats their row tiles there too, so kernels.matmul and a model's Linear take it; past
    # rows_n_max, BLAS on dequantized tiles as before. Q8_0 keeps its fused kernel and row tiles
    # (its GEMM is slower at these sizes), and so does every type where the target has no GEMM.
    assert [t for t in QUANTIZED if kernels.takes_int8_rows(kernels.get_unit(t))] == [*KQUANTS]
    rng = np.random.default_rng(int(qtype) + 3)
    unit = kernels.get_unit(qtype)
    parts = [
        kernels.QuantWeight.from_raw(random_blocks(qtype, rows * IN // 256, rng), qtype, (rows, IN))
        for rows in (OUT, 5)
    ]
    gemm, tiles = kernels.bind_row_wise(parts, int8=True), kernels.bind_row_wise(parts)
    for n in (unit.small_n_max + 1, unit.rows_n_max):
        x = rng.standard_normal((n, IN)).astype(np.float32)
        want = gemm(x)
        assert not np.array_equal(want, tiles(x))  # the two paths round differently
        assert np.array_equal(kernels.matmul(x, parts[0]), want[:, :OUT]), n
        assert np.array_equal(Linear(parts)(x), want), n
    x = rng.standard_normal((unit.rows_n_max + 1, IN)).astype(np.float32)
    assert not np.array_equal(kernels.matmul(x, parts[0]), gemm(x)[:, :OUT])
    x = rng.standard_normal((unit.small_n_max + 1, IN)).astype(np.float32)
    monkeypatch.setattr(sys.modules["edgeinfer.kernels.matmul"], "INT8_ENABLED", False)
    assert np.array_equal(Linear(parts)(x), tiles(x))


TARGET_RUN = (
    "from edgeinfer.kernels import byte_gemm, int8_gemm; "
    "print(int8_gemm.ENABLED, byte_gemm.ENABLED)"
)
on_x86 = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="x86-64 CPU names: this host compiles for another architecture",
)


@on_x86
@pytest.mark.parametrize(
    "cpu, features, enabled, bytes_enabled",
    [
        ("x86-64-v3", "+avx2", True, True),  # AVX2: byte_gemm on vpmaddubsw (Q8_0: 16-bit)
        ("x86-64-v4", "+avx512f", True, False),  # AVX-512 without VNNI's byte dot products
        ("znver4", "+avx512f,+avx512vnni", True, True),  # byte_gemm
        ("x86-64-v2", "", False, False),  # SSE4.2 only: 128-bit vectors
    ],
)
def test_the_gemm_follows_the_compile_target(cpu, features, enabled, bytes_enabled):
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features)
    proc = subprocess.run(
        [sys.executable, "-c", TARGET_RUN], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(enabled), str(bytes_enabled)]
    units = [kernels.get_unit(t) for t in QUANTIZED]
    if byte_gemm.ENABLED:  # this host's: AVX2's 16-bit pair sums would saturate on Q8_0's q
        names = {
            t: u.matmul_int8.kernel.py_func.__name__ for t, u in zip(QUANTIZED, units, strict=True)
        }
        sixteen_bit = {T.Q8_0} if byte_gemm.MADD else set()
        assert {t for t, name in names.items() if not name.endswith("_bytes")} == sixteen_bit


@on_x86
@pytest.mark.parametrize(
    "cpu, features, needs",
    [
        ("x86-64-v3", "+avx2", "+avx2"),  # AVX2: byte_gemm on vpmaddubsw, Q8_0 on 16-bit sums
        ("x86-64-v4", "+avx512f", "+avx512f"),  # no byte dot products: all on int8_gemm's 16 bits
    ],
)
def test_the_gemm_on_targets_without_byte_dot_products(cpu, features, needs):
    # the exact-math test above, compiled for the target in its own process
    if needs not in target_features():
        pytest.skip(f"the host cannot run {cpu} code")
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features)
    test = "test_int8_gemm_is_exact_math_on_rounded_activations"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", test],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(QUANTIZED)} passed" in proc.stdout
