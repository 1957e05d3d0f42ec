"""The paged KV cache: per-layer pools of fixed-size blocks (the scheduler's BlockManager says
which sequence owns which block; this module only holds the arrays).

k[layer]: [num_blocks, n_kv_heads, head_dim, block_size] (keys as columns),
v[layer]: [num_blocks, n_kv_heads, block_size, v_head_dim] — see kernels.attention.
"f16" stores float16 bit patterns as uint16 (what the attention kernel widens as it reads them;
Numba has no float16 arithmetic), "f32" stores float32. "q8_0" and "q4_0" (llama.cpp's
-ctk/-ctv of those names) store each token's head vectors in groups of QUANT_GROUP values, a
float16 scale per group: k[layer] and v[layer] are then pairs (codes, scales) of the same layouts,
the head axis in codes / codes_per_element and in scales / QUANT_GROUP (kernels.kv_store).
The pools are anonymous maps whose pages are committed only as blocks are first written, huge
pages only for a pool big enough to make them pay (`_zeros`).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from edgeinfer.config import ConfigError
from edgeinfer.gguf.model_config import ModelConfig

BLOCK_SIZE = 16
# Values per float16 scale of a quantized cache: ggml's block of 32 (kernels.kv_store.GROUP).
QUANT_GROUP = 32
# A layer's K or V of at least this many bytes takes huge pages (see _zeros).
HUGE_PAGES_FROM = 16 << 20


@dataclass(frozen=True)
class KVStorage:
    storage: type  # numpy type of the stored elements (values, or codes)
    per_element: int = 1  # values per stored element (q4_0: two 4-bit codes a byte)
    scaled: bool = False  # a float16 scale per QUANT_GROUP values of a head

    def row_bytes(self, dim: int) -> int:
        """Bytes of one token's head vector of dim values."""
        scales = dim // QUANT_GROUP * 2 if self.scaled else 0
        return dim // self.per_element * np.dtype(self.storage).itemsize + scales


KV_DTYPES = {
    "f16": KVStorage(np.uint16),
    "f32": KVStorage(np.float32),
    "q8_0": KVStorage(np.int8, scaled=True),
    "q4_0": KVStorage(np.uint8, per_element=2, scaled=True),
}


def check_kv_dtype(name: str) -> str:
    if name not in KV_DTYPES:
        raise ConfigError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, not {name!r}")
    return name


def check_kv_dims(name: str, head_dim: int, v_head_dim: int) -> None:
    """A quantized cache needs head dims made of whole groups (llama.cpp refuses them too)."""
    if KV_DTYPES[check_kv_dtype(name)].scaled and (
        head_dim % QUANT_GROUP or v_head_dim % QUANT_GROUP
    ):
        raise ConfigError(
            f"a {name} KV cache quantizes each head in groups of {QUANT_GROUP} values: this "
            f"model's head dims ({head_dim} for K, {v_head_dim} for V) are not multiples of "
            f"{QUANT_GROUP}; use --kv-dtype f16"
        )


class KVCache:
    """Pools for the layers in `layers` (default: all n_layers); k[i] and v[i] are None for a
    layer whose cache lives elsewhere (a ggml span's, on its backend), and (codes, scales) pairs
    for a quantized dtype. The layers in `window_layers` (sliding-window layers, a subset of
    `layers`) keep theirs in a second pool of num_window_blocks blocks (see block_manager)."""

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
        window_layers: list[int] = (),
        num_window_blocks: int = 0,
    ):
        check_kv_dims(dtype, head_dim, v_head_dim)
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_window_blocks = num_window_blocks
        self.window_layers = list(window_layers)
        layers = list(range(n_layers)) if layers is None else layers
        full = [i for i in layers if i not in self.window_layers]
        shape = (n_kv_heads, head_dim, v_head_dim, block_size, dtype)
        self.full = _Pool(len(full), num_blocks, *shape)
        self.window = _Pool(len(self.window_layers), num_window_blocks, *shape)
        # Per-layer views built once: the forward pass indexes lists, not 5-D arrays.
        self.k: list = [None] * n_layers
        self.v: list = [None] * n_layers
        for pool, group in ((self.full, full), (self.window, self.window_layers)):
            for j, i in enumerate(group):
                self.k[i], self.v[i] = pool.layer(j)

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_blocks: int,
        dtype: str = "f16",
        layers: list | None = None,
        window_layers: list[int] = (),
        num_window_blocks: int = 0,
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
            window_layers,
            num_window_blocks,
        )

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.window.nbytes


class _Pool:
    """Blocks of n_layers layers: K, V (and a quantized cache's scales) as 5-D arrays."""

    def __init__(self, n_layers, num_blocks, n_kv_heads, head_dim, v_head_dim, block_size, dtype):
        t = KV_DTYPES[dtype]
        pool = (n_layers, num_blocks, n_kv_heads)
        self.scaled = t.scaled
        k_shape = (*pool, head_dim // t.per_element, block_size)
        v_shape = (*pool, block_size, v_head_dim // t.per_element)
        huge = int(np.prod(k_shape[1:])) * np.dtype(t.storage).itemsize >= HUGE_PAGES_FROM
        self.k_pool = _zeros(k_shape, t.storage, huge)
        self.v_pool = _zeros(v_shape, t.storage, huge)
        # the scales of a quantized cache (float16 bits), empty otherwise
        groups = (head_dim // QUANT_GROUP, v_head_dim // QUANT_GROUP) if t.scaled else (0, 0)
        self.k_scales = _zeros((*pool, groups[0], block_size), np.uint16, huge=False)
        self.v_scales = _zeros((*pool, block_size, groups[1]), np.uint16, huge=False)

    def layer(self, j: int) -> tuple:
        """Layer j's (K, V) as the attention kernel takes them."""
        if self.scaled:
            return (self.k_pool[j], self.k_scales[j]), (self.v_pool[j], self.v_scales[j])
        return self.k_pool[j], self.v_pool[j]

    @property
    def nbytes(self) -> int:
        return self.k_pool.nbytes + self.v_pool.nbytes + self.k_scales.nbytes + self.v_scales.nbytes


def _zeros(shape: tuple, dtype, huge: bool) -> np.ndarray:
    """Zeros whose pages are committed as they are first written, in huge pages (2 MiB) or not.
    Huge pages make long-context decode faster (1B model at 8k tokens: 6 %) but commit 2 MiB of
    a layer's pool at its first token: with a layer's pool of a few MiB (1B model, 512 tokens,
    4 sequences: 2.4 MiB), the first token would commit most of the cache (60 of 76 MiB). numpy
    advises huge pages for every array of 4 MiB or more, so the pools are maps of their own."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous: zero-filled on demand
    advice = "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE"
    if hasattr(mmap, advice):  # Linux; transparent huge pages may also be on for every map
        pages.madvise(getattr(mmap, advice))
    return np.frombuffer(pages, dtype).reshape(shape)
