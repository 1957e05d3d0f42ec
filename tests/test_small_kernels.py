"""Small transformer kernels (norm, RoPE, gated activations, soft-cap, softmax, float16 store)
against plain numpy written from the definitions."""

import numpy as np
import pytest
from numba import njit

from edgeinfer.kernels.activations import GELU_TANH, SILU, gated_act, softcap_, softmax
from edgeinfer.kernels.kv_store import float_to_half, widen
from edgeinfer.kernels.norm import add_rms_norm, rms_norm
from edgeinfer.kernels.rope import apply_rope, rope_inv_freq
from edgeinfer.kernels.simd import row_max

RNG = np.random.default_rng(0)


def ref_rms_norm(x, w, eps):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w).astype(np.float32)


@pytest.mark.parametrize("n", [1, 3, 70])  # serial and parallel paths
def test_rms_norm(n):
    x = RNG.standard_normal((n, 96), dtype=np.float32) * 3
    w = RNG.standard_normal(96, dtype=np.float32)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 65])  # serial and parallel paths
@pytest.mark.parametrize("post", [False, True])
def test_add_rms_norm(n, post):
    x = RNG.standard_normal((n, 64), dtype=np.float32)
    delta = RNG.standard_normal((n, 64), dtype=np.float32)
    w = RNG.standard_normal(64, dtype=np.float32)
    post_w = RNG.standard_normal(64, dtype=np.float32) if post else np.zeros(0, np.float32)
    want_x = x + (ref_rms_norm(delta, post_w, 1e-5) if post else delta)
    h = add_rms_norm(x, delta, post_w, w, 1e-5)
    np.testing.assert_allclose(x, want_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h, ref_rms_norm(want_x, w, 1e-5), rtol=1e-4, atol=1e-5)


def ref_rope(x, positions, n_dims, base, neox, freq_scale=1.0, factors=None):
    # Written from the definition: pair i rotates by p * freq_scale * base^(-2i/n_dims) / f_i.
    out = x.astype(np.float64).copy()
    half = n_dims // 2
    for t, p in enumerate(positions):
        for i in range(half):
            theta = p * freq_scale * base ** (-2.0 * i / n_dims)
            if factors is not None:
                theta /= factors[i]
            c, s = np.cos(theta), np.sin(theta)
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            x0, x1 = out[t, :, a].copy(), out[t, :, b].copy()
            out[t, :, a] = x0 * c - x1 * s
            out[t, :, b] = x0 * s + x1 * c
    return out.astype(np.float32)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_dims", [32, 16])  # full and partial rotary
def test_rope(neox, n_dims):
    x = RNG.standard_normal((5, 3, 32), dtype=np.float32)
    positions = np.array([0, 1, 7, 300, 4095], np.int32)
    want = ref_rope(x, positions, n_dims, 10000.0, neox)
    apply_rope(x, positions, rope_inv_freq(n_dims, 10000.0), neox)
    np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-4)


def test_rope_scaling_and_factors():
    x = RNG.standard_normal((3, 2, 16), dtype=np.float32)
    positions = np.array([3, 100, 2000], np.int32)
    factors = np.linspace(1.0, 8.0, 8).astype(np.float32)
    want = ref_rope(x, positions, 16, 500000.0, False, freq_scale=0.25, factors=factors)
    apply_rope(x, positions, rope_inv_freq(16, 500000.0, 0.25, factors), False)
    np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-4)


def ref_gelu_tanh(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("n", [1, 40])  # serial and parallel paths
@pytest.mark.parametrize("kind", [SILU, GELU_TANH])
def test_gated_act(n, kind):
    gu = RNG.standard_normal((n, 2 * 48), dtype=np.float32) * 4
    gate, up = gu[:, :48].astype(np.float64), gu[:, 48:]
    act = gate / (1 + np.exp(-gate)) if kind == SILU else ref_gelu_tanh(gate)
    np.testing.assert_allclose(gated_act(gu, kind), act * up, rtol=1e-5, atol=1e-5)


def test_softcap():
    x = RNG.standard_normal((4, 50), dtype=np.float32) * 60
    want = 30.0 * np.tanh(x / 30.0)
    softcap_(x, 30.0)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)


def test_softmax():
    x = RNG.standard_normal((3, 1000), dtype=np.float32) * 10
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(softmax(x), e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-9)


@njit(cache=True)
def _row_max(x, at, n):
    return row_max(x, at, n)


def test_row_max_reads_exactly_its_span():
    # whole vectors of 16, then a tail: the largest value sits in each part in turn, and larger
    # values just outside the span must not count
    for n in (1, 5, 15, 16, 17, 40, 64, 75):
        for where in sorted({0, n // 2, n - 1}):
            x = RNG.standard_normal(n + 6).astype(np.float32) - 10
            x[2], x[3 + n] = 100.0, 200.0  # neighbours of the span x[3 : 3 + n]
            x[3 + where] = 7.0
            assert _row_max(x, 3, n) == np.float32(7.0)
    x = np.full(20, -np.inf, np.float32)
    assert _row_max(x, 0, 20) == -np.inf


@njit(cache=True)
def _to_half(x, out):
    for i in range(x.shape[0]):
        out[i] = float_to_half(x[i])


def test_float_to_half_matches_numpy():
    special = np.array(
        [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 5.96e-8, 2.98e-8,
         2.99e-8, 1e-9, np.inf, -np.inf, np.nan],
        np.float32,
    )  # fmt: skip
    # Ties: halfway between two halves must round to even.
    ties = (np.arange(1, 2048, dtype=np.float32) + 0.5) * np.float32(2.0**-10)
    scales = np.float32(2.0) ** RNG.integers(-30, 17, 20000).astype(np.float32)
    rand = RNG.standard_normal(20000).astype(np.float32) * scales
    x = np.concatenate([special, ties, rand])
    got = np.empty(x.size, np.uint16)
    _to_half(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


@njit(cache=True)
def _widen_njit(cache, dst):
    widen(cache, 0, 0, dst)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32], ids=["f16", "f32"])
def test_widen_cache_block_is_exact(dtype):
    # Every finite half (normal, subnormal, +-0) widens bit-exactly, as numpy's astype does.
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    halves = bits[np.isfinite(bits.view(np.float16))]
    halves = halves[: halves.size // 64 * 64].reshape(-1, 64)
    src = halves if dtype == np.uint16 else halves.view(np.float16).astype(np.float32)
    got = np.empty(src.shape, np.float32)
    _widen_njit(src[None, None], got)  # as block 0, head 0 of a cache
    want = halves.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
