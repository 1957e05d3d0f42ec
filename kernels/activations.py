"""Gated FFN activations, logit soft-capping, softmax, and the float32 exp they share.

The gated FFN keeps gate and up projections in one buffer (the fused gate/up matmul writes
[gate | up] per row), so one kernel reads both halves and writes act(gate) * up.
"""

import math

import numpy as np
from numba import njit, prange

PARALLEL_MIN_ROWS = 32
SILU = 0
GELU_TANH = 1

_SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_GELU_COEF_A = np.float32(0.044715)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so that n * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)


@njit(cache=True)
def exp_f32(x):
    """float32 e^x, relative error ~2e-7, with no branches or libm call so loops over it
    vectorize (libm's expf is a scalar call).

    x below -87 gives ~1e-38 instead of a subnormal or 0; NaN is not propagated.
    """
    x = min(max(np.float32(x), np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * _LOG2E + _HALF)
    r = x - n * _LN2_HI - n * _LN2_LO  # |r| <= ln2 / 2
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + _HALF
    p = p * r + _ONE
    p = p * r + _ONE
    scale = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
    return np.float32(p * scale)


# error_model="numpy": Python's division-by-zero check is a branch that stops the loops over
# these functions from vectorizing; x / 0 gives inf instead.
@njit(cache=True, error_model="numpy")
def tanh_f32(x):
    """float32 tanh through exp_f32 (absolute error ~1e-7)."""
    return _ONE - np.float32(2.0) / (exp_f32(np.float32(2.0) * x) + _ONE)


@njit(cache=True, error_model="numpy")
def _gated_row(gu, kind, out, at):
    # gu: [2f] = [gate | up] -> out[at : at + f] = act(gate) * up
    f = gu.shape[0] // 2
    if kind == GELU_TANH:
        for j in range(f):
            g = gu[j]
            inner = _SQRT_2_OVER_PI * g * (_ONE + _GELU_COEF_A * g * g)
            out[at + j] = _HALF * g * (_ONE + tanh_f32(inner)) * gu[f + j]
    else:
        for j in range(f):
            g = gu[j]
            out[at + j] = g / (_ONE + exp_f32(-g)) * gu[f + j]


# gu: [n, 2f] -> out[:, at : at + f] (gated_act)
@njit(cache=True)
def _gated_serial(gu, kind, out, at):
    for i in range(gu.shape[0]):
        _gated_row(gu[i], kind, out[i], at)


# as _gated_serial, rows in parallel
@njit(parallel=True, cache=True)
def _gated_parallel(gu, kind, out, at):
    for i in prange(gu.shape[0]):
        _gated_row(gu[i], kind, out[i], at)


def gated_act(gu: np.ndarray, kind: int, out: np.ndarray | None = None, at: int = 0) -> np.ndarray:
    """gu: float32[n, 2f] = [gate | up] -> act(gate) * up: float32[n, f], or written into the
    columns at .. at + f of out (float32[n, >= at + f], C-contiguous), which is returned.

    kind: SILU (SwiGLU: llama, qwen) or GELU_TANH (GeGLU with the tanh approximation: gemma).
    """
    n, two_f = gu.shape
    if out is None:
        out = np.empty((n, two_f // 2), np.float32)
    if n < PARALLEL_MIN_ROWS:
        _gated_serial(gu, kind, out, at)
    else:
        _gated_parallel(gu, kind, out, at)
    return out


# x: [n, v] -> cap * tanh(x / cap), in place
@njit(parallel=True, cache=True)
def _softcap(x, cap):
    for i in prange(x.shape[0]):
        for j in range(x.shape[1]):
            x[i, j] = cap * np.tanh(x[i, j] / cap)


def softcap_(x: np.ndarray, cap: float) -> None:
    """x: float32[n, v] -> cap * tanh(x / cap), in place (gemma's final-logit soft-capping)."""
    _softcap(x, np.float32(cap))


# x: [n, v] -> out: [n, v]
@njit(parallel=True, cache=True)
def _softmax(x, out):
    for i in prange(x.shape[0]):
        m = -math.inf
        for j in range(x.shape[1]):
            m = max(m, x[i, j])
        s = 0.0
        for j in range(x.shape[1]):
            e = np.exp(x[i, j] - m)
            out[i, j] = e
            s += e
        inv = np.float32(1.0 / s)
        for j in range(x.shape[1]):
            out[i, j] *= inv


def softmax(x: np.ndarray) -> np.ndarray:
    """x: float32[n, v] -> float32[n, v], softmax of each row (max-subtracted, sums in float64)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _softmax(x, out)
    return out
