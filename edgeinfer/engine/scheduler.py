"""Continuous batching: which sequences run in the next step, and how many tokens each.

Plain Python on plain numbers (no numpy): the engine hands the decision to the runner. The
scheduler is the one owner of the BlockManager: it allocates blocks at admission, hands out the
cache slots of every scheduled token, commits computed blocks to the prefix cache, and frees.
A sequence here is anything with `seq_id`, `token_ids` (prompt + output so far), `priority`,
`arrival` (a counter: lower came first) and `num_computed` (leading tokens whose K/V are in the
cache); a step computes `remaining = len(token_ids) - num_computed` more of them, all at once
or as a chunk. When a step computes the last remaining token, the engine samples the next one,
so a decoding sequence has exactly one token to compute per step.

Order: higher priority first, then earlier arrival. Each step
1. gives every running sequence its tokens (decode: 1; a prompt: a chunk), in that order, within
   `max_num_batched_tokens`; when the KV cache runs out, the last sequence in that order is
   preempted: its blocks are freed and it waits to be recomputed from its tokens (prefix caching
   usually brings most of them back);
2. admits waiting sequences in order while `max_num_seqs` and the token budget allow, preempting
   running sequences of lower priority when that makes room.
3. lets decoding sequences carry draft tokens (speculative decoding: `drafts`, seq_id -> the
   tokens a proposer guessed come next) with what the step leaves of the token budget and the
   free blocks: drafts never delay a prompt chunk nor preempt anyone. A verified step keeps the
   drafts the model agreed with; `commit` gives back the slots (and blocks) of the rest.
With nothing running, a partial batch waits up to `max_wait_s` for more requests first.
A model with sliding-window layers (gemma3) keeps their cache in a second pool, `window_blocks`
(see block_manager): every check above counts both pools, a prefix is reused as far as both
have it, and each step first releases the window blocks its sequences have slid past.
Admission (`Engine.add`) refuses a sequence that could never fit the cache alone, so the first
sequence in order can always run and preemption always makes progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgeinfer.engine.block_manager import RELEASED, BlockManager

if TYPE_CHECKING:
    from edgeinfer.config import EngineConfig


def rank(seq) -> tuple[int, int]:
    return (-seq.priority, seq.arrival)


@dataclass
class Chunk:
    """Tokens of one sequence computed in one step, with everything the runner needs."""

    seq: object  # the Sequence (None for an evaluation pass, Engine.forward)
    token_ids: list[int]
    start: int  # position of token_ids[0]
    slots: list[int] = field(default_factory=list)  # cache slot of each token
    block_table: list[int] = field(default_factory=list)  # the sequence's blocks after the step
    window_slots: list[int] = field(default_factory=list)  # the same in the sliding-window pool
    window_block_table: list[int] = field(default_factory=list)
    wants_logits: bool = False  # the chunk ends the known tokens: sample after it
    num_draft: int = 0  # its last num_draft tokens are guesses to verify: logits after each


@dataclass
class ScheduledBatch:
    chunks: list[Chunk] = field(default_factory=list)
    wait_s: float = 0.0  # nothing scheduled: how long to wait for more requests

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(
        self, blocks: BlockManager, config: EngineConfig, window_blocks: BlockManager | None = None
    ):
        self.blocks = blocks
        self.window_blocks = window_blocks
        self.pools = [blocks] if window_blocks is None else [blocks, window_blocks]
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_wait_s = config.max_wait_ms / 1000
        self.waiting: list = []  # in rank order
        self.running: list = []
        self.arrived_at: dict[int, float] = {}  # seq_id -> when it started waiting
        self.num_preemptions = 0
        # blocks (per pool) the runner will take for sequences scheduled in the step being planned
        self._promised: dict[int, list[int]] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq, now: float) -> None:
        seq.num_computed = 0
        self._enqueue(seq, now)

    def remove(self, seq) -> None:
        """Forget a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.arrived_at.pop(seq.seq_id, None)
        for pool in self.pools:
            pool.free(seq.seq_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their K/V were lost with a device)."""
        for pool in self.pools:
            pool.reset_prefix_cache()

    def schedule(self, now: float, drafts: dict[int, list[int]] | None = None) -> ScheduledBatch:
        """Choose the step's chunks and hand out their cache slots; drafts: see the module."""
        batch = ScheduledBatch()
        self._promised.clear()
        if self.window_blocks:
            for seq in self.running:
                self.window_blocks.slide(seq.seq_id, seq.num_computed)
        if not self.running and self.waiting:
            oldest = min(self.arrived_at[s.seq_id] for s in self.waiting)
            left = self.max_wait_s - (now - oldest)
            if len(self.waiting) < self.max_num_seqs and left > 0:
                batch.wait_s = left
                return batch
        for seq in sorted(self.running, key=rank):
            budget = self.max_num_batched_tokens - batch.num_tokens
            if budget == 0:
                break
            if seq not in self.running:  # preempted for a sequence ahead of it
                continue
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if self._make_room(seq, n, batch, now):
                batch.chunks.append(_chunk(seq, n))
        while self.waiting and batch.num_tokens < self.max_num_batched_tokens:
            seq = self.waiting[0]
            cached = self._admit(seq, batch, now)
            if cached is None:
                break
            del self.waiting[0]
            self.arrived_at.pop(seq.seq_id, None)
            self.running.append(seq)
            for pool in self.pools:
                seq.num_computed = pool.allocate(seq.seq_id, seq.token_ids, cached)
            budget = self.max_num_batched_tokens - batch.num_tokens
            batch.chunks.append(_chunk(seq, min(len(seq.token_ids) - seq.num_computed, budget)))
        if drafts:
            self._add_drafts(batch, drafts)
        for chunk in batch.chunks:  # room was made for each: appending cannot fail
            self._hand_out_slots(chunk, chunk.seq.seq_id)
        return batch

    def _hand_out_slots(self, chunk: Chunk, seq_id: int) -> None:
        chunk.slots = self.blocks.append(seq_id, len(chunk.token_ids))
        chunk.block_table = self.blocks.block_table(seq_id)
        if self.window_blocks:
            chunk.window_slots = self.window_blocks.append(seq_id, len(chunk.token_ids))
            chunk.window_block_table = self.window_blocks.block_table(seq_id)

    def commit(self, batch: ScheduledBatch, rejected: dict[int, int] | None = None) -> None:
        """After the step ran: its tokens' K/V are in the cache (full blocks become reusable),
        except the last rejected[seq_id] draft tokens of a sequence, whose slots are given back.
        Call it before the accepted tokens join seq.token_ids."""
        for chunk in batch.chunks:
            seq = chunk.seq
            computed = seq.token_ids
            kept = len(chunk.token_ids)
            if chunk.num_draft:
                gone = rejected[seq.seq_id] if rejected else 0
                for pool in self.pools:
                    pool.rollback(seq.seq_id, gone)
                kept -= gone
                computed = computed[: chunk.start] + chunk.token_ids[:kept]
            seq.num_computed += kept
            for pool in self.pools:
                pool.commit(seq.seq_id, computed)

    def extend(self, seq_id: int, token_ids: list[int], start: int) -> Chunk:
        """Slots for an evaluation pass outside the queue (Engine.forward); KVCacheFullError
        and nothing changed if the free blocks do not suffice."""
        if self.window_blocks:
            self.window_blocks.slide(seq_id, start)  # (blocks it will never read again)
        for pool in self.pools:  # every pool has room, or none changes
            pool.check_append(seq_id, len(token_ids))
        chunk = Chunk(None, token_ids, start, wants_logits=True)
        self._hand_out_slots(chunk, seq_id)
        return chunk

    def seq_len(self, seq_id: int) -> int:
        return self.blocks.seq_len(seq_id)

    def release(self, seq_id: int) -> None:
        """Free an evaluation pass's blocks."""
        for pool in self.pools:
            pool.free(seq_id)

    def _make_room(self, seq, n: int, batch: ScheduledBatch, now: float) -> bool:
        """Preempt from the back of the order until seq can grow by n; False if seq itself
        had to go."""
        need = self._needed(seq.seq_id, n)
        while not _within(need, self._free_blocks()):
            victim = max(self.running, key=rank)
            self._preempt(victim, batch, now)
            if victim is seq:
                return False
        self._promised[seq.seq_id] = need
        return True

    def _add_drafts(self, batch: ScheduledBatch, drafts: dict[int, list[int]]) -> None:
        """Append each decoding sequence's draft to its chunk, as far as the token budget and
        the free blocks go; not in a step that computes a prompt chunk (it takes the slower
        prompt kernels, where every draft row costs a full row)."""
        if any(c.start != len(c.seq.token_ids) - 1 for c in batch.chunks):
            return
        for chunk in batch.chunks:
            seq = chunk.seq
            draft = drafts.get(seq.seq_id)
            if not draft:
                continue
            n = min(len(draft), self.max_num_batched_tokens - batch.num_tokens)
            promised = self._promised.get(seq.seq_id, [0] * len(self.pools))
            while n and not _within(
                [a - b for a, b in zip(self._needed(seq.seq_id, 1 + n), promised, strict=True)],
                self._free_blocks(),
            ):
                n -= 1
            if n:
                chunk.token_ids = chunk.token_ids + draft[:n]
                chunk.num_draft = n
                self._promised[seq.seq_id] = self._needed(seq.seq_id, 1 + n)

    def _needed(self, seq_id: int, n: int) -> list[int]:
        """New blocks of each pool seq_id needs to grow by n tokens."""
        return [pool.blocks_needed(seq_id, n) for pool in self.pools]

    def _free_blocks(self) -> list[int]:
        """Free blocks of each pool, less those promised to this step's sequences."""
        return [
            pool.num_free_blocks - sum(promised[i] for promised in self._promised.values())
            for i, pool in enumerate(self.pools)
        ]

    def _admit(self, seq, batch: ScheduledBatch, now: float) -> int | None:
        """Make room for a waiting sequence, preempting only sequences of lower priority and
        only when that can be enough -> the leading blocks of its prompt found cached in every
        pool (allocate them), or None if there is no room."""
        cached = None
        for pool in self.pools:
            cached = pool.cached_prefix_blocks(seq.token_ids, cached)
        chunk = min(len(seq.token_ids) - cached * self.blocks.block_size,
                    self.max_num_batched_tokens - batch.num_tokens)  # fmt: skip

        def need() -> list[int]:
            return [p.blocks_to_allocate(seq.token_ids, cached, chunk) for p in self.pools]

        def fits() -> bool:
            return len(self.running) < self.max_num_seqs and _within(need(), self._free_blocks())

        if fits():
            return cached
        lower = sorted(
            (s for s in self.running if s.priority < seq.priority), key=rank, reverse=True
        )
        reclaimable = [sum(self._blocks_freed_by(s, p) for s in lower) for p in self.pools]
        room = [free + more for free, more in zip(self._free_blocks(), reclaimable, strict=True)]
        if not lower or not _within(need(), room):
            return None
        for victim in lower:
            self._preempt(victim, batch, now)
            if fits():
                return cached
        return None

    def _blocks_freed_by(self, seq, pool: BlockManager) -> int:
        refs = pool.ref_counts
        return sum(1 for b in pool.block_table(seq.seq_id) if b != RELEASED and refs[b] == 1)

    def _preempt(self, seq, batch: ScheduledBatch, now: float) -> None:
        self.running.remove(seq)
        self._promised.pop(seq.seq_id, None)
        for pool in self.pools:
            pool.free(seq.seq_id)
        seq.num_computed = 0
        batch.chunks = [c for c in batch.chunks if c.seq is not seq]
        self.num_preemptions += 1
        self._enqueue(seq, now)

    def _enqueue(self, seq, now: float) -> None:
        key = rank(seq)
        i = next((i for i, s in enumerate(self.waiting) if rank(s) > key), len(self.waiting))
        self.waiting.insert(i, seq)
        self.arrived_at[seq.seq_id] = now


def _within(need: list[int], free: list[int]) -> bool:
    return all(n <= f for n, f in zip(need, free, strict=True))


def _chunk(seq, n: int) -> Chunk:
    start = seq.num_computed
    return Chunk(
        seq, seq.token_ids[start : start + n], start, wants_logits=start + n == len(seq.token_ids)
    )
