"""The block manager alone: reference counts, prefix caching, LRU eviction, rollback of rejected
draft tokens, and a stateful fuzz."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edgeinfer.engine.block_manager import BlockManager, KVCacheFullError, block_key

BS = 4


def run(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """Admit a sequence and 'compute' its remaining tokens, as the engine does."""
    cached = bm.allocate(seq_id, tokens)
    bm.append(seq_id, len(tokens) - cached)
    bm.commit(seq_id, tokens)
    return cached


def test_identical_prefixes_share_blocks_and_the_last_token_is_always_computed():
    bm = BlockManager(16, BS)
    a = list(range(10))  # blocks [0-3] [4-7] and a partial one
    assert run(bm, 1, a) == 0
    b = a[:8] + [99, 98, 97]
    assert run(bm, 2, b) == 8
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2]
    assert bm.block_table(2)[2] != bm.block_table(1)[2]
    assert [bm.ref_counts[x] for x in bm.block_table(1)[:2]] == [2, 2]
    # a prompt that is exactly the cached blocks still computes its last token
    assert run(bm, 3, a[:8]) == 4
    assert bm.num_hit_tokens == 12 and bm.num_queried_tokens == 10 + 11 + 8


def test_a_different_earlier_block_breaks_the_chain():
    bm = BlockManager(16, BS)
    run(bm, 1, list(range(12)))
    other = [50, 1, 2, 3] + list(range(4, 12))  # same second block, different first
    assert run(bm, 2, other) == 0


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    bm = BlockManager(4, BS)
    old, new = [1] * 8 + [2], [3] * 8 + [4]
    run(bm, 1, old)
    bm.free(1)
    assert bm.num_free_blocks == 4  # cached blocks count as free
    run(bm, 2, new)  # 3 blocks: the 2 unkeyed ones, then evicts one of old's, its tail first
    bm.free(2)
    assert run(bm, 3, new) == 8
    bm.free(3)
    assert run(bm, 4, old) == 4  # old's first block outlived its second


def test_reviving_a_cached_block_counts_against_the_free_pool():
    bm = BlockManager(3, BS)
    tokens = list(range(9))  # three blocks
    run(bm, 1, tokens)
    bm.free(1)
    assert bm.blocks_to_allocate(tokens) == 3  # two revived + one fresh
    assert bm.can_allocate(tokens)
    run(bm, 2, list(range(100, 104)))  # one block, evicting a cached one
    assert not bm.can_allocate(tokens + [7, 7, 7, 7])
    with pytest.raises(KVCacheFullError, match="KV cache full"):
        bm.allocate(3, tokens + [7, 7, 7, 7])
    assert 3 not in bm.tables  # the failed call changed nothing


def test_a_prefix_computed_twice_keeps_one_cached_copy():
    bm = BlockManager(8, BS)
    tokens = list(range(9))
    bm.allocate(1, tokens)
    bm.allocate(2, tokens)  # both admitted before either computed anything: no hits
    for s in (1, 2):
        bm.append(s, 9)
        bm.commit(s, tokens)
    keyed = [b for b in range(8) if bm.block_keys[b] is not None]
    assert len(keyed) == 2 and len(bm.cached) == 2
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 8


def test_without_prefix_caching_nothing_is_reused():
    bm = BlockManager(8, BS, prefix_caching=False)
    run(bm, 1, list(range(9)))
    assert run(bm, 2, list(range(9))) == 0
    assert not bm.cached


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, growth and frees with a small alphabet, so prefixes collide often."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, prompt):
        seq = self.next_id
        self.next_id += 1
        if not self.bm.can_allocate(prompt):
            with pytest.raises(KVCacheFullError):
                self.bm.allocate(seq, prompt)
            return
        cached = self.bm.allocate(seq, prompt)
        assert cached % BS == 0 and cached < len(prompt)
        self.bm.append(seq, len(prompt) - cached)
        self.bm.commit(seq, prompt)
        self.tokens[seq] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 6))
    def grow(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.bm.can_append(seq, n):
            with pytest.raises(KVCacheFullError):
                self.bm.append(seq, n)
            return
        self.bm.append(seq, n)
        self.tokens[seq] += data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        self.bm.commit(seq, self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 6))
    def speculate(self, data, n):
        """A verify step: n slots for a token and its drafts, the rejected ones rolled back."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.bm.can_append(seq, n):
            return
        self.bm.append(seq, n)
        kept = data.draw(st.integers(1, n))
        with pytest.raises(ValueError, match="past its committed blocks"):
            self.bm.rollback(seq, self.bm.seq_len(seq) + 1)  # refused, nothing changed
        self.bm.rollback(seq, n - kept)
        self.tokens[seq] += data.draw(st.lists(st.integers(0, 2), min_size=kept, max_size=kept))
        self.bm.commit(seq, self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    @invariant()
    def counts_match_owners(self):
        bm = self.bm
        owners = [0] * bm.num_blocks
        for seq, table in bm.tables.items():
            assert len(set(table)) == len(table)  # no block twice in one table
            assert len(table) * BS >= bm.seq_len(seq) == len(self.tokens[seq])
            for b in table:
                owners[b] += 1
        assert bm.ref_counts == owners  # never negative, never stale
        free = set(bm.free_blocks) | set(bm.evictable)
        assert len(free) == len(bm.free_blocks) + len(bm.evictable)  # not free twice
        assert free == {b for b in range(bm.num_blocks) if owners[b] == 0}
        assert all(bm.block_keys[b] is None for b in bm.free_blocks)
        assert {b: k for k, b in bm.cached.items()} == {
            b: k for b, k in enumerate(bm.block_keys) if k is not None
        }

    @invariant()
    def keys_cover_only_kept_tokens(self):
        # a rolled-back token never reaches a key: each key names the prefix that was kept
        for seq, tokens in self.tokens.items():
            parent, want = b"", []
            for i in range(len(tokens) // BS):
                parent = block_key(parent, tokens[i * BS : (i + 1) * BS])
                want.append(parent)
            assert self.bm.keys[seq] == want

    def teardown(self):
        for seq in list(self.tokens):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert not self.bm.tables and all(r == 0 for r in self.bm.ref_counts)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
test_block_manager_state_machine = BlockManagerMachine.TestCase
