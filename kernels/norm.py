"""RMS norm, plain and fused with the residual add that precedes it in every transformer block.

Sums of squares accumulate in float64, as ggml does, so long rows do not lose precision.
Decode rows are short and few: below `PARALLEL_MIN_ROWS` rows the serial kernels run, because
waking the thread pool costs more than the work.
"""

import numpy as np
from numba import njit, prange

PARALLEL_MIN_ROWS = 64


# Reassociating the float64 sum lets it vectorize.
@njit(cache=True, fastmath={"reassoc"})
def _inv_rms(x, eps):
    # x: [d] -> 1 / sqrt(mean(x^2) + eps)
    s = 0.0
    for j in range(x.shape[0]):
        s += np.float64(x[j]) * np.float64(x[j])
    return np.float32(1.0 / np.sqrt(s / x.shape[0] + eps))


@njit(cache=True)
def _norm_row(x, w, eps, out):
    # x: [d], w: [d] -> out: [d] = x / rms(x) * w
    r = _inv_rms(x, eps)
    for j in range(x.shape[0]):
        out[j] = x[j] * r * w[j]


@njit(cache=True)
def _add_norm_row(x, delta, post_w, w, eps, out, tmp):
    # x: [d] (updated in place), delta: [d]; post_w: [d] or [0] (no post-norm) -> out: [d]
    if post_w.shape[0] > 0:
        _norm_row(delta, post_w, eps, tmp)
        for j in range(x.shape[0]):
            x[j] += tmp[j]
    else:
        for j in range(x.shape[0]):
            x[j] += delta[j]
    _norm_row(x, w, eps, out)


# x: [n, d], w: [d] -> out: [n, d] (a row at a time: rms_norm)
@njit(cache=True)
def _rms_norm_serial(x, w, eps, out):
    for i in range(x.shape[0]):
        _norm_row(x[i], w, eps, out[i])


# x: [n, d], w: [d] -> out: [n, d] (rows in parallel)
@njit(parallel=True, cache=True)
def _rms_norm_parallel(x, w, eps, out):
    for i in prange(x.shape[0]):
        _norm_row(x[i], w, eps, out[i])


# x: [n, d] (updated in place), delta: [n, d], post_w: [d] or [0], w: [d] -> out: [n, d]
# (add_rms_norm)
@njit(cache=True)
def _add_norm_serial(x, delta, post_w, w, eps, out):
    tmp = np.empty(x.shape[1], np.float32)
    for i in range(x.shape[0]):
        _add_norm_row(x[i], delta[i], post_w, w, eps, out[i], tmp)


# as _add_norm_serial, rows in parallel
@njit(parallel=True, cache=True)
def _add_norm_parallel(x, delta, post_w, w, eps, out):
    for i in prange(x.shape[0]):
        tmp = np.empty(x.shape[1], np.float32)
        _add_norm_row(x[i], delta[i], post_w, w, eps, out[i], tmp)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: float32[n, d], w: float32[d] -> float32[n, d] = x / rms(x) * w (per row)."""
    out = np.empty_like(x)
    if x.shape[0] < PARALLEL_MIN_ROWS:
        _rms_norm_serial(x, w, eps, out)
    else:
        _rms_norm_parallel(x, w, eps, out)
    return out


def add_rms_norm(
    x: np.ndarray, delta: np.ndarray, post_w: np.ndarray, w: np.ndarray, eps: float
) -> np.ndarray:
    """Residual step then pre-norm: x += rms_norm(delta) * post_w (or x += delta when post_w is
    empty); returns rms_norm(x) * w.

    x: float32[n, d] residual stream (updated in place), delta: float32[n, d],
    post_w: float32[d] or float32[0], w: float32[d] -> float32[n, d]
    """
    out = np.empty_like(x)
    if x.shape[0] < PARALLEL_MIN_ROWS:
        _add_norm_serial(x, delta, post_w, w, eps, out)
    else:
        _add_norm_parallel(x, delta, post_w, w, eps, out)
    return out
