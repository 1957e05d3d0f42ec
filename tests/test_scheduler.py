"""The scheduler alone, on stand-in sequences: budgets, chunked prefill, priorities, preemption."""

import itertools

import pytest

from edgeinfer.config import EngineConfig
from edgeinfer.engine.block_manager import BlockManager
from edgeinfer.engine.scheduler import MAX_DECODE_ROWS, MIN_DECODE_ROWS, Scheduler

BS = 4
_ids = itertools.count()


class Seq:
    def __init__(self, prompt_len: int, priority: int = 0, first_token: int = 0):
        self.seq_id = self.arrival = next(_ids)
        self.priority = priority
        self.token_ids = list(range(first_token, first_token + prompt_len))
        self.num_computed = 0


def advance(s: Scheduler, batch) -> None:
    """What the engine does with a step once it ran: commit it, and give every sequence whose
    tokens are all computed a new one."""
    s.commit(batch)
    for chunk in batch.chunks:
        if chunk.wants_logits:
            chunk.seq.token_ids.append(7)


def pairs(batch) -> list[tuple[Seq, int]]:
    return [(c.seq, len(c.token_ids)) for c in batch.chunks]


def make(num_blocks=64, max_num_seqs=8, max_tokens=32, wait=0.0):
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, max_wait_ms=wait * 1000
    )
    return Scheduler(BlockManager(num_blocks, BS), config)


def test_decodes_and_prompt_chunks_share_one_step_within_the_token_budget():
    s = make(max_tokens=10)
    a = Seq(3)
    s.add(a, 0)
    advance(s, s.schedule(0))  # a's prompt
    b = Seq(20)
    s.add(b, 0)
    batch = s.schedule(0)
    assert [(q, n) for q, n in pairs(batch)] == [(a, 1), (b, 9)]
    advance(s, batch)
    batch = s.schedule(0)
    assert [(q, n) for q, n in pairs(batch)] == [(a, 1), (b, 9)]
    advance(s, batch)
    assert [(q, n) for q, n in pairs(s.schedule(0))] == [(a, 1), (b, 2)]


def test_max_num_seqs_bounds_the_running_set():
    s = make(max_num_seqs=2)
    seqs = [Seq(2) for _ in range(3)]
    for q in seqs:
        s.add(q, 0)
    batch = s.schedule(0)
    assert [q for q, _ in pairs(batch)] == seqs[:2] and s.waiting == [seqs[2]]
    s.remove(seqs[0])
    assert [q for q, _ in pairs(s.schedule(0))] == [seqs[1], seqs[2]]


def test_higher_priority_is_admitted_first_and_preempts_lower_ones():
    s = make(max_num_seqs=1)
    low = Seq(2, priority=0)
    s.add(low, 0)
    advance(s, s.schedule(0))
    high = Seq(2, priority=5)
    s.add(high, 0)
    batch = s.schedule(0)
    assert [q for q, _ in pairs(batch)] == [high] and s.num_preemptions == 1
    assert low.num_computed == 0 and s.blocks.block_table(low.seq_id) == []
    assert s.waiting == [low]
    # an equal priority does not preempt: it waits its turn
    s2 = make(max_num_seqs=1)
    first, second = Seq(2), Seq(2)
    s2.add(first, 0)
    advance(s2, s2.schedule(0))
    s2.add(second, 0)
    assert [q for q, _ in pairs(s2.schedule(0))] == [first]


def test_running_out_of_blocks_preempts_the_last_in_order_and_it_is_recomputed():
    s = make(num_blocks=4)  # 16 tokens in all
    a, b = Seq(7), Seq(7, first_token=100)
    s.add(a, 0)
    s.add(b, 0)
    advance(s, s.schedule(0))  # 2 blocks each
    advance(s, s.schedule(0))  # both have 8 tokens computed: the next one needs a third block
    batch = s.schedule(0)
    assert [q for q, _ in pairs(batch)] == [a] and s.waiting == [b]
    assert s.num_preemptions == 1 and b.num_computed == 0
    while len(a.token_ids) < 14:
        advance(s, s.schedule(0))
    s.remove(a)
    batch = s.schedule(0)  # b comes back and recomputes its prompt and its output so far
    assert pairs(batch) == [(b, len(b.token_ids))]


def test_a_lone_sequence_that_outgrows_the_cache_preempts_itself_without_looping():
    s = make(num_blocks=2)
    a = Seq(8)
    s.add(a, 0)
    advance(s, s.schedule(0))
    batch = s.schedule(0)  # a needs a third block
    assert batch.chunks == [] and s.waiting == [a] and s.num_preemptions == 1


def test_a_partial_batch_waits_for_more_requests_up_to_max_wait():
    s = make(max_num_seqs=2, wait=0.05)
    a = Seq(2)
    s.add(a, 10.0)
    batch = s.schedule(10.01)
    assert batch.chunks == [] and batch.wait_s == pytest.approx(0.04)
    assert [q for q, _ in pairs(s.schedule(10.06))] == [a]
    full = make(max_num_seqs=2, wait=0.05)
    pair = [Seq(2), Seq(2)]
    for q in pair:
        full.add(q, 10.0)
    assert [q for q, _ in pairs(full.schedule(10.0))] == pair  # a full batch does not wait


def test_drafts_take_what_the_budget_and_free_blocks_allow_and_give_rejected_blocks_back():
    s = make(num_blocks=4, max_tokens=12)
    a, b = Seq(3), Seq(7)
    s.add(a, 0)
    s.add(b, 0)
    advance(s, s.schedule(0))  # both prompts: a has 4 tokens (1 block), b 8 (2 blocks)
    c = Seq(9)
    s.add(c, 0)  # waits: 3 blocks, 1 free
    batch = s.schedule(0, {a.seq_id: [1, 2, 3, 4, 5, 6, 7], b.seq_id: [9] * 10})
    # a decodes 1 token + drafts: the free block holds only 4 more of its tokens; b gets none:
    # its draft would need another block; drafts never preempt (c could not be admitted)
    assert [
        (q, n, ch.num_draft) for (q, n), ch in zip(pairs(batch), batch.chunks, strict=True)
    ] == [
        (a, 5, 4),
        (b, 1, 0),
    ]
    assert batch.chunks[0].token_ids == [0, 1, 2, 7, 1, 2, 3, 4][3:] and s.num_preemptions == 0
    assert s.blocks.num_free_blocks == 0
    # none of a's drafts accepted: their slots, and the block they took, go back
    s.commit(batch, {a.seq_id: 4})
    assert a.num_computed == s.blocks.seq_len(a.seq_id) == 4 and b.num_computed == 8
    assert s.blocks.num_free_blocks == 1


def test_drafts_ride_ahead_of_a_prompt_chunk_within_the_token_budget():
    s = make(max_tokens=8)
    a = Seq(3)
    s.add(a, 0)
    advance(s, s.schedule(0))
    assert s.draft_room() == MIN_DECODE_ROWS  # decode tokens only, of one sequence
    b = Seq(9)
    s.add(b, 0)
    assert s.draft_room() == 4  # a prompt waits: half the step's budget
    batch = s.schedule(0, {a.seq_id: [1, 2, 3, 4, 5, 6, 7, 8]})
    # a's token and 3 draft tokens, then the rest of the budget for b's prompt
    assert [(q, n, c.num_draft) for (q, n), c in zip(pairs(batch), batch.chunks, strict=True)] == [
        (a, 4, 3),
        (b, 4, 0),
    ]
    s.commit(batch, {a.seq_id: 1})
    assert s.draft_room() == 4  # b's prompt is not done
    assert a.num_computed == 6 and b.num_computed == 4


@pytest.mark.parametrize("n, rows", [(1, 16), (3, 16), (8, 32), (20, 64), (30, 64)])
def test_a_step_of_decode_tokens_only_trims_drafts_to_its_row_limit(n, rows):
    s = make(max_tokens=512, num_blocks=512, max_num_seqs=n)
    seqs = [Seq(3) for _ in range(n)]
    for q in seqs:
        s.add(q, 0)
    advance(s, s.schedule(0))
    assert s.draft_room() == rows == max(MIN_DECODE_ROWS, min(MAX_DECODE_ROWS, 4 * n))
    free = s.blocks.num_free_blocks
    s.add(Seq(5), 0)  # waits for a place (max_num_seqs): the next step was to compute its prompt
    assert s.draft_room() == 256
    # drafts proposed for a step with a prompt, in a step that has none after all: the longest
    # give up their last tokens first
    batch = s.schedule(0, {q.seq_id: list(range(40)) for q in seqs})
    assert [c.seq for c in batch.chunks] == seqs
    assert batch.num_tokens == rows
    drafts = [c.num_draft for c in batch.chunks]
    assert max(drafts) - min(d for d in drafts if d) <= 1 and sum(drafts) == rows - n
    for c in batch.chunks:
        assert c.token_ids == [7] + list(range(c.num_draft)) and len(c.slots) == 1 + c.num_draft
    # the blocks taken are the trimmed chunks' blocks, no more
    held = sum(-(-(3 + len(c.token_ids)) // BS) - 1 for c in batch.chunks)
    assert s.blocks.num_free_blocks == free - held
