"""KV-cache block bookkeeping on plain ints: which physical blocks each sequence owns.

No numpy here (the scheduler and tests use it alone). A sequence's block table lists its
blocks in position order; position p lives in block table[p // block_size] at offset
p % block_size, i.e. slot table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from collections import deque

from edgeinfer.errors import EdgeInferError


class KVCacheFullError(EdgeInferError):
    """Not enough free KV-cache blocks for the tokens asked for."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def seq_len(self, seq_id: int) -> int:
        return self.lengths.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])

    def blocks_needed(self, seq_id: int, n_tokens: int) -> int:
        """New blocks seq_id needs to grow by n_tokens."""
        have = len(self.tables.get(seq_id, ()))
        need = -(-(self.seq_len(seq_id) + n_tokens) // self.block_size)
        return max(0, need - have)

    def can_append(self, seq_id: int, n_tokens: int) -> bool:
        return self.blocks_needed(seq_id, n_tokens) <= len(self.free_blocks)

    def append(self, seq_id: int, n_tokens: int) -> list[int]:
        """Grow seq_id by n_tokens (allocating blocks) -> the slot of each new token."""
        need = self.blocks_needed(seq_id, n_tokens)
        if need > len(self.free_blocks):
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id} needs {need} more blocks of "
                f"{self.block_size} tokens, {len(self.free_blocks)} free"
            )
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self.free_blocks.popleft())
        start = self.lengths.get(seq_id, 0)
        self.lengths[seq_id] = start + n_tokens
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n_tokens)]

    def free(self, seq_id: int) -> None:
        """Return all of seq_id's blocks to the pool (unknown ids are a no-op)."""
        self.free_blocks.extend(self.tables.pop(seq_id, ()))
        self.lengths.pop(seq_id, None)
