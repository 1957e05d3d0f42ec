"""The span's KV cache on its backend, addressed by the host cache's block ids and slots.

Per layer, K and V are [kv_heads * head_dim, rows] tensors (one row per token slot, rows as
llama.cpp keeps them for flash attention). Row 0 is a scratch row: the padding tokens of a
bucketed graph write their K/V there and attend only to it, so they never touch a real slot;
slot s (block * block_size + offset, the scheduler's) is row s + 1. The block manager, prefix
cache and preemption therefore work unchanged: the same block id means the same rows here.

The attention mask is built from the batch's block tables and positions: token t of sequence
row s sees the rows of its own sequence's positions <= its position (and, in a sliding-window
layer, > position - window); everything else is -inf.
"""

from __future__ import annotations

import numpy as np

from .backends import Backend
from .graph import F16, F32, Builder
from .lib import GGMLError

SCRATCH_ROWS = 1
ROW_ALIGN = 256  # views of the cache grow in steps of this many rows (ggml's CUDA FA pads so)
KV_TYPES = {"f16": F16, "f32": F32}


def bucket_rows(rows: int, total: int) -> int:
    return min(total, -(-rows // ROW_ALIGN) * ROW_ALIGN)


class DeviceKV:
    """K/V tensors for `n_layers` layers of `num_blocks` blocks of `block_size` slots."""

    def __init__(
        self,
        backend: Backend,
        n_layers: int,
        k_dim: int,
        v_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: str,
    ):
        self.rows = bucket_rows(SCRATCH_ROWS + num_blocks * block_size, 1 << 62)
        self.block_size = block_size
        self.type = KV_TYPES[dtype]
        self.ctx = Builder(2 * n_layers)
        self.k = [self.ctx.new(self.type, k_dim, self.rows) for _ in range(n_layers)]
        self.v = [self.ctx.new(self.type, v_dim, self.rows) for _ in range(n_layers)]
        lib = self.ctx.lib
        self.buffer = lib.ggml_backend_alloc_ctx_tensors(self.ctx.ctx, backend.ptr)
        if not self.buffer:
            self.ctx.free()
            raise GGMLError(f"ggml {backend.name}: could not allocate the KV cache")
        lib.ggml_backend_buffer_clear(self.buffer, 0)  # unwritten rows read as 0, never NaN
        self.nbytes = lib.ggml_backend_buffer_get_size(self.buffer)

    @staticmethod
    def bytes_needed(n_layers: int, dims: int, num_blocks: int, block_size: int, dtype: str) -> int:
        """dims: k_dim + v_dim of one layer."""
        if dtype not in KV_TYPES:  # (every path to a span's cache plans it here first)
            raise GGMLError(
                f"--kv-dtype {dtype}: layers that ggml runs keep an f16 or f32 KV cache"
            )
        rows = bucket_rows(SCRATCH_ROWS + num_blocks * block_size, 1 << 62)
        return n_layers * rows * dims * (2 if dtype == "f16" else 4)

    def view_rows(self, block_tables: np.ndarray) -> int:
        """Rows the batch's attention must see: up to its highest block, bucketed."""
        top = int(block_tables.max()) + 1 if block_tables.size else 0
        return bucket_rows(SCRATCH_ROWS + top * self.block_size, self.rows)

    def close(self) -> None:
        if self.buffer:
            self.ctx.lib.ggml_backend_buffer_free(self.buffer)
            self.buffer = 0
        self.ctx.free()


def device_rows(slots: np.ndarray, n_pad: int) -> np.ndarray:
    """int64[n_pad]: each token's cache row; padding tokens write the scratch row 0."""
    rows = np.zeros(n_pad, np.int64)
    rows[: len(slots)] = slots + SCRATCH_ROWS
    return rows


def sequence_rows(position: int, table: np.ndarray, block_size: int) -> np.ndarray:
    """int64[position + 1]: the cache rows of a sequence's positions 0 .. position, in order."""
    logical = np.arange(position + 1)
    return (
        table[logical // block_size].astype(np.int64) * block_size
        + logical % block_size
        + SCRATCH_ROWS
    )


def causal_mask(position: int, n_cols: int, window: int) -> np.ndarray:
    """float16[1, n_cols] for one token over its sequence's rows gathered in order."""
    cols = np.arange(n_cols)
    visible = cols <= position
    if window:
        visible &= cols > position - window
    return np.where(visible, 0, -np.inf).astype(np.float16)[None, :]


def attention_mask(
    positions: np.ndarray,
    seq_rows: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    n_pad: int,
    n_rows: int,
    window: int,
) -> np.ndarray:
    """float16[n_pad, n_rows]: 0 where a token may attend, -inf elsewhere (see the module)."""
    mask = np.full((n_pad, n_rows), -np.inf, np.float16)
    n = len(positions)
    mask[n:, 0] = 0  # padding tokens see only the scratch row
    offsets = np.arange(block_size)
    for s in np.unique(seq_rows):
        tokens = np.flatnonzero(seq_rows == s)
        pos = positions[tokens].astype(np.int64)
        logical = np.arange(int(pos.max()) + 1)
        table = block_tables[s, : -(-len(logical) // block_size)].astype(np.int64)
        rows = ((table[:, None] * block_size + offsets).reshape(-1) + SCRATCH_ROWS)[: len(logical)]
        visible = logical[None, :] <= pos[:, None]
        if window:
            visible &= logical[None, :] > pos[:, None] - window
        mask[tokens[:, None], rows[None, :]] = np.where(visible, 0, -np.inf).astype(np.float16)
    return mask
