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
   tokens a proposer guessed come next) in the blocks the other chunks left free (drafts never
   preempt anyone), up to `draft_room` rows with the decode tokens: in a step that computes a
   prompt chunk, up to half the token budget, kept from the prompt chunks of steps 1 and 2 (a
   draft row there costs what a prompt row costs, a fraction of a decode step's row); in a step
   of decode tokens only, `decode_step_rows` in all. A verified step keeps the drafts the
   model agreed with; `commit` gives back the slots (and blocks) of the rest.
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

# Rows of a step of decode tokens only (one per sequence plus its draft tokens), by how many
# sequences decode. With many, a row up to 4 a sequence costs about half of what a row of the
# step without drafts costs (16 sequences of SmolLM2, 1 thread: 105 ms at 16 rows, 266 ms at
# 64), so drafts accepted more than half the time pay; with few, rows past the fused kernels'
# range cost nearly a full row (4 sequences: drafts up to 28 rows, 4.0 s for the decode phase of
# bench/speculative.py's streams, up to 16 rows 3.4 s, none 3.5 s).
MIN_DECODE_ROWS = 16
ROWS_PER_SEQUENCE = 4
MAX_DECODE_ROWS = 64


def decode_step_rows(decoding: int) -> int:
    """Rows a step of `decoding` sequences' decode tokens and their drafts may hold."""
    return max(MIN_DECODE_ROWS, min(MAX_DECODE_ROWS, ROWS_PER_SEQUENCE * decoding))


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
        self._reserved = 0  # tokens of the step being planned kept for drafts

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
        # budget the drafts keep from prompt chunks (more than they may get: blocks decide)
        self._reserved = 0
        if drafts:
            room = self.draft_room()
            wanted = sum(len(d) for d in drafts.values())
            self._reserved = max(0, min(wanted, room - self._decoding()))
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
            n = len(seq.token_ids) - seq.num_computed
            if n > 1:  # a prompt chunk
                n = min(n, self._prompt_budget(batch))
            if n > 0 and self._make_room(seq, n, batch, now):
                batch.chunks.append(_chunk(seq, n))
        while self.waiting and self._prompt_budget(batch) > 0:
            seq = self.waiting[0]
            cached = self._admit(seq, batch, now)
            if cached is None:
                break
            del self.waiting[0]
            self.arrived_at.pop(seq.seq_id, None)
            self.running.append(seq)
            for pool in self.pools:
                seq.num_computed = pool.allocate(seq.seq_id, seq.token_ids, cached)
            budget = self._prompt_budget(batch)
            batch.chunks.append(_chunk(seq, min(len(seq.token_ids) - seq.num_computed, budget)))
        if drafts:
            self._add_drafts(batch, drafts, room)
            if not _computes_prompt(batch):
                self._trim_drafts(batch)
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

    def draft_room(self) -> int:
        """Rows the next step can give decoding sequences and their drafts together: half its
        token budget where a prompt chunk will be computed (the other half stays the prompts'),
        else `decode_step_rows`."""
        decoding = self._decoding()
        if self.waiting or decoding < len(self.running):
            return self.max_num_batched_tokens // 2
        return decode_step_rows(decoding)

    def _decoding(self) -> int:
        """Running sequences past their prompt."""
        return sum(s.num_computed == len(s.token_ids) - 1 for s in self.running)

    def _prompt_budget(self, batch: ScheduledBatch) -> int:
        """Tokens the step's next prompt chunk may take."""
        return self.max_num_batched_tokens - batch.num_tokens - self._reserved

    def _add_drafts(self, batch: ScheduledBatch, drafts: dict[int, list[int]], room: int) -> None:
        """Append to each decoding sequence's chunk, in order, as much of its draft as the token
        budget, `room` (the step's decoding rows) and the blocks every other chunk left free
        allow."""
        rows = sum(len(c.token_ids) for c in batch.chunks if _decodes(c))
        for chunk in batch.chunks:
            seq_id = chunk.seq.seq_id
            draft = drafts.get(seq_id)
            if not draft or not _decodes(chunk):
                continue
            n = min(len(draft), self.max_num_batched_tokens - batch.num_tokens, room - rows)
            promised = self._promised.get(seq_id, [0] * len(self.pools))
            while n > 0 and not _within(
                [a - b for a, b in zip(self._needed(seq_id, 1 + n), promised, strict=True)],
                self._free_blocks(),
            ):
                n -= 1
            if n > 0:
                chunk.token_ids = chunk.token_ids + draft[:n]
                chunk.num_draft = n
                rows += n
                self._promised[seq_id] = self._needed(seq_id, 1 + n)

    def _trim_drafts(self, batch: ScheduledBatch) -> None:
        """A step of decode tokens only (no prompt came in after all): the longest drafts give
        up their last tokens until it fits `decode_step_rows`."""
        while batch.num_tokens > decode_step_rows(len(batch.chunks)):
            chunk = max(batch.chunks, key=lambda c: c.num_draft)
            if not chunk.num_draft:
                break
            chunk.token_ids = chunk.token_ids[:-1]
            chunk.num_draft -= 1
            self._promised[chunk.seq.seq_id] = self._needed(chunk.seq.seq_id, len(chunk.token_ids))

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
                    self._prompt_budget(batch))  # fmt: skip

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


def _decodes(chunk: Chunk) -> bool:
    return chunk.start == len(chunk.seq.token_ids) - 1


def _computes_prompt(batch: ScheduledBatch) -> bool:
    return not all(_decodes(c) for c in batch.chunks)


def _within(need: list[int], free: list[int]) -> bool:
    return all(n <= f for n, f in zip(need, free, strict=True))


def _chunk(seq, n: int) -> Chunk:
    start = seq.num_computed
    return Chunk(
        seq, seq.token_ids[start : start + n], start, wants_logits=start + n == len(seq.token_ids)
    )
