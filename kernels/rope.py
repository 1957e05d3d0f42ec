"""Rotary position embedding, both of ggml's layouts.

normal (llama): dimension pairs (2i, 2i+1) rotate together — GGUF conversion permutes Llama's
Q/K rows so that this matches the Hugging Face rotate_half layout.
NeoX (qwen2, qwen3, gemma3): pairs (i, i + n_dims/2).
Only the first n_dims dimensions of a head rotate (partial rotary); the rest pass through.
The angle for pair i at position p is p * inv_freq[i]; all scaling (linear factor, llama3
per-frequency factors) is folded into inv_freq once at load.
"""

import numpy as np
from numba import njit, prange


def rope_inv_freq(
    n_dims: int, base: float, freq_scale: float = 1.0, freq_factors: np.ndarray | None = None
) -> np.ndarray:
    """-> float64[n_dims // 2]: freq_scale * base^(-2i / n_dims) / freq_factors[i]."""
    inv = freq_scale * base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, np.float64)[: n_dims // 2]
    return inv


@njit(cache=True)
def rope_cos_sin(pos, inv_freq, cos, sin):
    # pos: int, inv_freq: [n_dims/2] -> cos, sin: [n_dims/2]
    for i in range(inv_freq.shape[0]):
        t = pos * inv_freq[i]
        cos[i] = np.cos(t)
        sin[i] = np.sin(t)


@njit(cache=True)
def rope_rotate(x, cos, sin, neox):
    # x: [d] rotated in place with the angles of one position; cos, sin: [n_dims/2]
    half = cos.shape[0]
    if neox:
        for i in range(half):
            x0 = x[i]
            x1 = x[i + half]
            x[i] = x0 * cos[i] - x1 * sin[i]
            x[i + half] = x0 * sin[i] + x1 * cos[i]
    else:
        for i in range(half):
            x0 = x[2 * i]
            x1 = x[2 * i + 1]
            x[2 * i] = x0 * cos[i] - x1 * sin[i]
            x[2 * i + 1] = x0 * sin[i] + x1 * cos[i]


# x: [n, heads, head_dim] rotated in place, positions: [n], inv_freq: [n_dims/2]
@njit(parallel=True, cache=True)
def _rope(x, positions, inv_freq, neox):
    for t in prange(x.shape[0]):
        cos = np.empty(inv_freq.shape[0], np.float32)
        sin = np.empty(inv_freq.shape[0], np.float32)
        rope_cos_sin(positions[t], inv_freq, cos, sin)
        for h in range(x.shape[1]):
            rope_rotate(x[t, h], cos, sin, neox)


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, neox: bool) -> None:
    """x: float32[n, heads, head_dim] rotated in place; positions: int32[n]; inv_freq from
    `rope_inv_freq` (its length sets how many dimensions rotate)."""
    _rope(x, positions, inv_freq, neox)
