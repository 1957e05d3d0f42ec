"""Block bookkeeping (pure Python) and the KV block pools."""

import sys
from pathlib import Path

import numpy as np
import pytest

from edgeinfer.engine.block_manager import BlockManager, KVCacheFullError
from edgeinfer.engine.kv_cache import HUGE_PAGES_FROM, KVCache
from edgeinfer.errors import EdgeInferError


def test_slots_follow_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.append(seq_id=7, n_tokens=6)  # two blocks
    b = bm.append(seq_id=9, n_tokens=3)  # one block
    a += bm.append(seq_id=7, n_tokens=3)  # fills block 2 of seq 7, opens a third
    table = bm.block_table(7)
    assert len(table) == 3 and bm.seq_len(7) == 9 and bm.seq_len(9) == 3
    assert a == [table[p // 4] * 4 + p % 4 for p in range(9)]
    assert set(table).isdisjoint(bm.block_table(9))
    assert len({*a, *b}) == 12  # no slot handed out twice
    assert bm.num_free_blocks == 8 - 4


def test_blocks_needed_counts_partial_blocks():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert (
        bm.blocks_needed(1, 1) == 1
        and bm.blocks_needed(1, 16) == 1
        and bm.blocks_needed(1, 17) == 2
    )
    bm.append(1, 10)
    assert bm.blocks_needed(1, 6) == 0 and bm.blocks_needed(1, 7) == 1


def test_full_pool_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.append(1, 5)
    assert not bm.can_append(2, 5)
    with pytest.raises(KVCacheFullError) as e:
        bm.append(2, 5)
    assert isinstance(e.value, EdgeInferError) and "KV cache full" in str(e.value)
    assert bm.seq_len(2) == 0 and bm.num_free_blocks == 0


def test_free_returns_blocks_for_reuse():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.append(1, 6)
    assert bm.num_free_blocks == 0
    bm.free(1)
    bm.free(1)  # idempotent
    assert bm.num_free_blocks == 3 and bm.seq_len(1) == 0 and bm.block_table(1) == []
    assert sorted(bm.append(2, 6)) == list(range(6))


@pytest.mark.parametrize("dtype, storage", [("f16", np.uint16), ("f32", np.float32)])
def test_pools(dtype, storage):
    kv = KVCache(n_layers=3, n_kv_heads=2, head_dim=8, v_head_dim=4, num_blocks=5, dtype=dtype)
    assert len(kv.k) == 3 and kv.k[1].shape == (5, 2, 8, 16) and kv.v[2].shape == (5, 2, 16, 4)
    assert (
        kv.k[0].dtype == storage and kv.nbytes == 3 * 5 * 2 * 16 * 12 * np.dtype(storage).itemsize
    )
    kv.k[1][0, 0, 0, 0] = 1  # layer views alias the pool
    assert kv.full.k_pool[1, 0, 0, 0, 0] == 1


def test_bad_dtype():
    with pytest.raises(ValueError, match="f16"):
        KVCache(1, 1, 8, 8, 1, dtype="q8")


def _anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_pool_commits_memory_as_blocks_fill():
    """A 1B model's pools for four sequences (16 layers, 2.4 MiB per layer each of K and V):
    one block in every layer commits pages for that block, not 2 MiB huge pages per layer."""
    kv = KVCache(n_layers=16, n_kv_heads=8, head_dim=64, v_head_dim=64, num_blocks=152)
    assert kv.nbytes == 76 * 2**20
    before = _anon_mib()
    for i in range(16):
        kv.k[i][0] = 1
        kv.v[i][0] = 1
    assert _anon_mib() - before < 4  # 32 blocks of 16 KiB; huge pages would commit 60+ MiB
    assert all(int(kv.k[i][0].sum()) == kv.k[i][0].size for i in range(16))
    assert not kv.k[5][1:].any() and not kv.v[5][1:].any()  # the pages are zero-filled


def _huge_pages_eligible(a: np.ndarray) -> bool:
    """Whether the kernel may back the map holding `a` with huge pages (smaps' THPeligible)."""
    address, inside = a.ctypes.data, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError("no THPeligible line for the array's map")


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_only_a_big_pool_takes_huge_pages():
    small = KVCache(n_layers=2, n_kv_heads=8, head_dim=64, v_head_dim=64, num_blocks=152)
    big = KVCache(n_layers=2, n_kv_heads=8, head_dim=64, v_head_dim=64, num_blocks=1024)
    assert small.k[0].nbytes < HUGE_PAGES_FROM <= big.k[0].nbytes
    assert not _huge_pages_eligible(small.k[0]) and not _huge_pages_eligible(small.v[1])
    assert _huge_pages_eligible(big.k[0]) and _huge_pages_eligible(big.v[1])
