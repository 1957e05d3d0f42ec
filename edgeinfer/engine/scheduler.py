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
Admission (`Engine.add`) refuses a sequence that could never fit the cache alone, so the first
sequence in order can always run and preemption always makes progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgeinfer.engine.block_manager import BlockManager

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
    def __init__(self, blocks: BlockManager, config: EngineConfig):
        self.blocks = blocks
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_wait_s = config.max_wait_ms / 1000
        self.waiting: list = []  # in rank order
        self.running: list = []
        self.arrived_at: dict[int, float] = {}  # seq_id -> when it started waiting
        self.num_preemptions = 0
        # blocks the runner will take for sequences scheduled in the step being planned
        self._promised: dict[int, int] = {}

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
        self.blocks.free(seq.seq_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (their K/V were lost with a device)."""
        self.blocks.reset_prefix_cache()

    def schedule(self, now: float, drafts: dict[int, list[int]] | None = None) -> ScheduledBatch:
        """Choose the step's chunks and hand out their cache slots; drafts: see the module."""
        batch = ScheduledBatch()
        self._promised.clear()
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
            if not self._admit(seq, batch, now):
                break
            del self.waiting[0]
            self.arrived_at.pop(seq.seq_id, None)
            self.running.append(seq)
            seq.num_computed = self.blocks.allocate(seq.seq_id, seq.token_ids)
            budget = self.max_num_batched_tokens - batch.num_tokens
            batch.chunks.append(_chunk(seq, min(len(seq.token_ids) - seq.num_computed, budget)))
        if drafts:
            self._add_drafts(batch, drafts)
        for chunk in batch.chunks:  # room was made for each: appending cannot fail
            seq_id = chunk.seq.seq_id
            chunk.slots = self.blocks.append(seq_id, len(chunk.token_ids))
            chunk.block_table = self.blocks.block_table(seq_id)
        return batch

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
                self.blocks.rollback(seq.seq_id, gone)
                kept -= gone
                computed = computed[: chunk.start] + chunk.token_ids[:kept]
            seq.num_computed += kept
            self.blocks.commit(seq.seq_id, computed)

    def extend(self, seq_id: int, token_ids: list[int], start: int) -> Chunk:
        """Slots for an evaluation pass outside the queue (Engine.forward); KVCacheFullError
        and nothing changed if the free blocks do not suffice."""
        slots = self.blocks.append(seq_id, len(token_ids))
        return Chunk(None, token_ids, start, slots, self.blocks.block_table(seq_id), True)

    def seq_len(self, seq_id: int) -> int:
        return self.blocks.seq_len(seq_id)

    def release(self, seq_id: int) -> None:
        """Free an evaluation pass's blocks."""
        self.blocks.free(seq_id)

    def _make_room(self, seq, n: int, batch: ScheduledBatch, now: float) -> bool:
        """Preempt from the back of the order until seq can grow by n; False if seq itself
        had to go."""
        need = self.blocks.blocks_needed(seq.seq_id, n)
        while need > self._free_blocks():
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
            promised = self._promised.get(seq.seq_id, 0)
            while n and self.blocks.blocks_needed(seq.seq_id, 1 + n) - promised > (
                self._free_blocks()
            ):
                n -= 1
            if n:
                chunk.token_ids = chunk.token_ids + draft[:n]
                chunk.num_draft = n
                self._promised[seq.seq_id] = self.blocks.blocks_needed(seq.seq_id, 1 + n)

    def _free_blocks(self) -> int:
        return self.blocks.num_free_blocks - sum(self._promised.values())

    def _admit(self, seq, batch: ScheduledBatch, now: float) -> bool:
        """Make room for a waiting sequence, preempting only sequences of lower priority and
        only when that can be enough; False if there is no room."""

        def fits() -> bool:
            need = self.blocks.blocks_to_allocate(seq.token_ids)
            return len(self.running) < self.max_num_seqs and need <= self._free_blocks()

        if fits():
            return True
        lower = sorted(
            (s for s in self.running if s.priority < seq.priority), key=rank, reverse=True
        )
        reclaimable = sum(self._blocks_freed_by(s) for s in lower)
        need = self.blocks.blocks_to_allocate(seq.token_ids)
        if not lower or need > self._free_blocks() + reclaimable:
            return False
        for victim in lower:
            self._preempt(victim, batch, now)
            if fits():
                return True
        return False

    def _blocks_freed_by(self, seq) -> int:
        refs = self.blocks.ref_counts
        return sum(1 for b in self.blocks.block_table(seq.seq_id) if refs[b] == 1)

    def _preempt(self, seq, batch: ScheduledBatch, now: float) -> None:
        self.running.remove(seq)
        self._promised.pop(seq.seq_id, None)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        batch.chunks = [c for c in batch.chunks if c.seq is not seq]
        self.num_preemptions += 1
        self._enqueue(seq, now)

    def _enqueue(self, seq, now: float) -> None:
        key = rank(seq)
        i = next((i for i, s in enumerate(self.waiting) if rank(s) > key), len(self.waiting))
        self.waiting.insert(i, seq)
        self.arrived_at[seq.seq_id] = now


def _chunk(seq, n: int) -> Chunk:
    start = seq.num_computed
    return Chunk(
        seq, seq.token_ids[start : start + n], start, wants_logits=start + n == len(seq.token_ids)
    )
