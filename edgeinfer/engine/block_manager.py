"""KV-cache block bookkeeping on plain ints: which physical blocks each sequence owns.

No numpy here (the scheduler and tests use it alone). A sequence's block table lists its
blocks in position order; position p lives in block table[p // block_size] at offset
p % block_size, i.e. slot table[p // block_size] * block_size + p % block_size.

Prefix caching: once a block is full and its K/V computed, it is keyed by a digest of (the
previous block's key, its token ids), so a key names the whole prefix up to that block. A new
sequence whose prompt starts with the same tokens takes those blocks by reference count instead
of recomputing them. A block whose count drops to zero keeps its key and stays reusable until
it is evicted, least recently used first, to make room. Keys are SHA-256 digests: prompts are
untrusted, and a colliding key would hand one request another's K/V.

A sliding-window pool (`window` > 0, the cache of gemma3's local layers): a query at position p
reads keys from block first_needed(p) on (kernels.attention starts each tile there), so the
blocks of a sequence before first_needed(its next position) are released (`slide`; their table
entries become RELEASED). Keyed ones stay cached like any unreferenced block, so a later prompt
with the same prefix finds the last window of it: a prefix is reusable here when the blocks
its next token reads are all cached. Blocks are taken as the sequence grows (`append`), not for
the whole prompt at admission, so a long prompt holds about a window and a chunk at a time.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from edgeinfer.errors import EdgeInferError


class KVCacheFullError(EdgeInferError):
    """Not enough free KV-cache blocks for the tokens asked for."""


RELEASED = -1  # a sliding-window table's entry for a block that left the window


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = True, window: int = 0
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.window = window
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> block holding that prefix's last block
        # Unkeyed free blocks, used as a stack: reusing the most recently freed block keeps the
        # pool's touched (committed) pages as few as the peak use.
        self.free_blocks: list[int] = list(reversed(range(num_blocks)))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced; LRU first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens whose slots are handed out
        self.keys: dict[int, list[bytes]] = {}  # keys of the sequence's full, computed blocks
        self.released: dict[int, int] = {}  # leading RELEASED entries of each table
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a prefix a new request can reuse (evicted last-used
        first when the pool runs out)."""
        return len(self.evictable)

    def seq_len(self, seq_id: int) -> int:
        return self.lengths.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])

    # -- admission ---------------------------------------------------------------------------

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` reads (0 without a window)."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0

    def _prefix_hits(
        self, token_ids: list[int], limit: int | None = None
    ) -> tuple[list[bytes], list[int]]:
        """Keys and blocks of the cached full blocks token_ids starts with (at most `limit`;
        a sliding-window pool: RELEASED for those its next token does not read). The last token
        is never covered: its forward pass must run to give the logits of the next one."""
        keys, blocks = [], []
        if not self.prefix_caching:
            return keys, blocks
        bs, parent = self.block_size, b""
        for start in range(0, len(token_ids) - bs, bs):
            if len(keys) == limit:
                break
            parent = block_key(parent, token_ids[start : start + bs])
            block = self.cached.get(parent)
            if block is None and not self.window:
                break
            keys.append(parent)
            blocks.append(block)
        if self.window:  # the longest prefix whose last window is all here
            n = len(blocks)
            while n and None in blocks[self.first_needed(n * bs) : n]:
                n -= 1
            lo = self.first_needed(n * bs)
            keys, blocks = keys[:n], [RELEASED] * lo + blocks[lo:n]
        return keys, blocks

    def cached_prefix_blocks(self, token_ids: list[int], limit: int | None = None) -> int:
        """Leading full blocks of token_ids that `allocate` would find cached."""
        return len(self._prefix_hits(token_ids, limit)[0])

    def blocks_to_allocate(
        self, token_ids: list[int], limit: int | None = None, then: int = 0
    ) -> int:
        """Blocks `allocate(token_ids, limit)` would take from the free pool: new ones, plus
        cached prefix blocks that nobody references (they count as free until reused); and
        what appending the `then` tokens after its cached prefix would take next."""
        hits = self._prefix_hits(token_ids, limit)[1]
        table = self._table_blocks(len(token_ids), hits)
        grown = -(-(len(hits) * self.block_size + then) // self.block_size)
        return self._pool_blocks(len(token_ids), hits) + max(0, grown - table)

    def _table_blocks(self, n_tokens: int, hits: list[int]) -> int:
        """Blocks in a new sequence's table: all of its tokens' (a sliding-window pool: its
        cached prefix's; it takes the rest as the sequence grows)."""
        return len(hits) if self.window else -(-n_tokens // self.block_size)

    def _pool_blocks(self, n_tokens: int, hits: list[int]) -> int:
        revived = sum(1 for b in hits if b != RELEASED and self.ref_counts[b] == 0)
        return self._table_blocks(n_tokens, hits) - len(hits) + revived

    def can_allocate(self, token_ids: list[int]) -> bool:
        return self.blocks_to_allocate(token_ids) <= self.num_free_blocks

    def allocate(self, seq_id: int, token_ids: list[int], limit: int | None = None) -> int:
        """Give a new sequence blocks for all of token_ids (a sliding-window pool: for its
        cached prefix only), reusing at most `limit` cached prefix blocks -> the number of
        leading tokens whose K/V are already there (the sequence's length)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        keys, hits = self._prefix_hits(token_ids, limit)  # hashes every full block: once a call
        need = self._pool_blocks(len(token_ids), hits)
        if need > self.num_free_blocks:
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id} needs {need} blocks of "
                f"{self.block_size} tokens, {self.num_free_blocks} free"
            )
        for block in hits:
            if block == RELEASED:
                continue
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        total = self._table_blocks(len(token_ids), hits)
        self.tables[seq_id] = hits + [self._take_block() for _ in range(total - len(hits))]
        self.keys[seq_id] = keys
        self.released[seq_id] = hits.count(RELEASED)
        cached = len(hits) * self.block_size
        self.lengths[seq_id] = cached
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += cached
        return cached

    # -- growth ------------------------------------------------------------------------------

    def blocks_needed(self, seq_id: int, n_tokens: int) -> int:
        """New blocks seq_id needs to grow by n_tokens."""
        have = len(self.tables.get(seq_id, ()))
        need = -(-(self.seq_len(seq_id) + n_tokens) // self.block_size)
        return max(0, need - have)

    def can_append(self, seq_id: int, n_tokens: int) -> bool:
        return self.blocks_needed(seq_id, n_tokens) <= self.num_free_blocks

    def check_append(self, seq_id: int, n_tokens: int) -> int:
        """-> the new blocks seq_id needs to grow by n_tokens; KVCacheFullError if they are not
        free."""
        need = self.blocks_needed(seq_id, n_tokens)
        if need > self.num_free_blocks:
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id} needs {need} more blocks of "
                f"{self.block_size} tokens, {self.num_free_blocks} free"
            )
        return need

    def append(self, seq_id: int, n_tokens: int) -> list[int]:
        """Grow seq_id by n_tokens (allocating blocks) -> the slot of each new token."""
        need = self.check_append(seq_id, n_tokens)
        table = self.tables.setdefault(seq_id, [])
        self.keys.setdefault(seq_id, [])
        self.released.setdefault(seq_id, 0)
        table.extend(self._take_block() for _ in range(need))
        start = self.lengths.get(seq_id, 0)
        self.lengths[seq_id] = start + n_tokens
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n_tokens)]

    def rollback(self, seq_id: int, n_tokens: int) -> None:
        """Take back the slots of seq_id's last n_tokens (draft tokens the model rejected):
        blocks left empty go back to the free pool. Only tokens not yet committed can go, so
        no prefix-cache key ever covers a rejected token."""
        length = self.lengths[seq_id] - n_tokens
        if n_tokens < 0 or length < len(self.keys[seq_id]) * self.block_size:
            raise ValueError(
                f"sequence {seq_id}: cannot roll back {n_tokens} of {self.lengths[seq_id]} "
                "tokens past its committed blocks"
            )
        self.lengths[seq_id] = length
        table = self.tables[seq_id]
        # blocks past the new length were taken by this step's append: fresh, unkeyed, ours
        for _ in range(len(table) - -(-length // self.block_size)):
            block = table.pop()
            self.ref_counts[block] = 0
            self.free_blocks.append(block)

    def slide(self, seq_id: int, position: int) -> None:
        """A sliding-window pool: release seq_id's blocks that a query at `position` or later
        never reads (their K/V were computed, and committed if prefix caching is on)."""
        table = self.tables.get(seq_id)
        if not self.window or table is None:
            return
        start, stop = self.released[seq_id], min(self.first_needed(position), len(table))
        for i in range(start, stop):
            self._unref(table[i])
            table[i] = RELEASED
        self.released[seq_id] = max(start, stop)

    def commit(self, seq_id: int, token_ids: list[int]) -> None:
        """Key the blocks that filled up since the last call; token_ids covers at least the
        sequence's length (its K/V must already be written)."""
        if not self.prefix_caching:
            return
        keys, table, bs = self.keys[seq_id], self.tables[seq_id], self.block_size
        parent = keys[-1] if keys else b""
        for i in range(len(keys), self.lengths[seq_id] // bs):
            parent = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            keys.append(parent)
            block = table[i]
            # Another sequence may have computed the same prefix first: keep its block.
            if block != RELEASED and self.block_keys[block] is None and parent not in self.cached:
                self.block_keys[block] = parent
                self.cached[parent] = block

    def free(self, seq_id: int) -> None:
        """Drop seq_id's references (unknown ids are a no-op). Last blocks first, so that a
        prefix outlives its continuations in the LRU order."""
        for block in reversed(self.tables.pop(seq_id, ())):
            if block != RELEASED:
                self._unref(block)
        self.lengths.pop(seq_id, None)
        self.keys.pop(seq_id, None)
        self.released.pop(seq_id, None)

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_keys[block] is None:
                self.free_blocks.append(block)
            else:
                self.evictable[block] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: their K/V are gone (a device holding part of the cache
        was lost). Unreferenced cached blocks become plain free blocks; blocks in use keep
        serving their sequences, but no new request finds them."""
        self.free_blocks += list(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.block_keys = [None] * self.num_blocks

    def _take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_keys[block]]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block
