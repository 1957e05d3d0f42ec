"""The paged KV cache: per-layer pools of fixed-size blocks (the scheduler's BlockManager says
which sequence owns which block; this module only holds the arrays).

k[layer]: [num_blocks, n_kv_heads, head_dim, block_size] (keys as columns),
v[layer]: [num_blocks, n_kv_heads, block_size, v_head_dim] — see kernels.attention.
"f16" stores float16 bit patterns as uint16 (what the attention kernel widens as it reads them;
Numba has no float16 arithmetic), "f32" stores float32. The pools are allocated with np.zeros,
so pages are committed only as blocks are first written.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.config import ConfigError
from edgeinfer.gguf.model_config import ModelConfig

BLOCK_SIZE = 16
KV_DTYPES = {"f16": np.uint16, "f32": np.float32}


def check_kv_dtype(name: str) -> str:
    if name not in KV_DTYPES:
        raise ConfigError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, not {name!r}")
    return name


class KVCache:
    """Pools for the layers in `layers` (default: all n_layers); k[i] and v[i] are None for a
    layer whose cache lives elsewhere (a ggml span's, on its backend)."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        dtype: str = "f16",
        layers: list[int] | None = None,
    ):
        self.dtype = check_kv_dtype(dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        storage = KV_DTYPES[dtype]
        layers = list(range(n_layers)) if layers is None else layers
        n = len(layers)
        self.k_pool = np.zeros((n, num_blocks, n_kv_heads, head_dim, block_size), storage)
        self.v_pool = np.zeros((n, num_blocks, n_kv_heads, block_size, v_head_dim), storage)
        # Per-layer views built once: the forward pass indexes lists, not 5-D arrays.
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        for j, i in enumerate(layers):
            self.k[i], self.v[i] = self.k_pool[j], self.v_pool[j]

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, dtype: str = "f16", layers: list | None = None
    ) -> KVCache:
        return cls(
            config.n_layers,
            config.n_kv_heads,
            config.head_dim,
            config.v_head_dim,
            num_blocks,
            BLOCK_SIZE,
            dtype,
            layers,
        )

    @property
    def nbytes(self) -> int:
        return self.k_pool.nbytes + self.v_pool.nbytes
