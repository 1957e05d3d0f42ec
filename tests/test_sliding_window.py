"""Sliding-window layers keep only their window (gemma3's local layers): their own KV pool
releases the blocks a sequence slid past, holds at most a window and a step per sequence, and
every token still comes out as with a cache that keeps everything (llama.cpp's logits too);
a prefix is reused after its window slid, as long as the blocks its next token reads are cached."""

import re

import numpy as np
import pytest
from llama_oracle import oracle, oracle_logits

from edgeinfer.config import EngineConfig
from edgeinfer.engine.block_manager import RELEASED, BlockManager
from edgeinfer.engine.engine import Engine
from edgeinfer.engine.runner import ModelRunner
from edgeinfer.engine.sampling import SamplingParams

BS = 4
WINDOW = 10  # a query at position p reads from block (p - 9) // 4


def grow(bm: BlockManager, seq_id: int, tokens: list[int], step: int) -> int:
    """Compute tokens in steps as the scheduler does (slide, append, commit) -> most blocks held."""
    done = bm.allocate(seq_id, tokens)
    most = 0
    while done < len(tokens):
        bm.slide(seq_id, done)
        n = min(step, len(tokens) - done)
        bm.append(seq_id, n)
        most = max(most, bm.num_used_blocks)
        done += n
        bm.commit(seq_id, tokens)
    return most


def test_a_window_pool_holds_a_window_and_a_step_and_keeps_the_released_blocks_cached():
    bm = BlockManager(64, BS, window=WINDOW)
    tokens = list(range(200))
    # a step starting at p holds blocks (p - 9) // 4 .. (p + 5) // 4: at most 5 for 6-token steps
    assert grow(bm, 1, tokens, 6) == 5
    table = bm.block_table(1)
    # the last step started at position 198: blocks before (198 - 9) // 4 = 47 are released
    assert len(table) == 50 and table[:47] == [RELEASED] * 47 and RELEASED not in table[47:]
    # released blocks were full and committed: they stay cached, reusable, until evicted
    assert bm.num_cached_blocks + bm.num_used_blocks == 50
    bm.free(1)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 64


def test_a_prefix_is_reused_while_the_blocks_its_next_token_reads_are_cached():
    bm = BlockManager(64, BS, window=WINDOW)
    prompt = list(range(40))
    grow(bm, 1, prompt, 8)
    bm.free(1)
    second = prompt + [99]  # the next token (position 40) reads from block (40 - 9) // 4 = 7
    assert bm.allocate(2, second) == 40
    assert bm.block_table(2)[:7] == [RELEASED] * 7
    bm.free(2)
    # evict the block holding positions 36-39 (the prefix's last window): the reusable
    # prefix shrinks to one whose window is still cached
    bm2 = BlockManager(64, BS, window=WINDOW)
    grow(bm2, 1, prompt, 8)
    bm2.free(1)  # LRU order: blocks 0-4 (released as the window slid), then 9, 8, 7, 6, 5
    bm2.append(7, 60 * BS)  # the 54 unkeyed blocks, then the 6 least recently used
    assert bm2.allocate(2, second) == 36  # position 36 reads blocks 6-8: still cached
    # with the full layers' pool finding fewer blocks, the window pool takes no more than that
    assert bm.cached_prefix_blocks(second, 5) == 5
    assert bm.allocate(3, second, 5) == 20 and bm.block_table(3)[:2] == [RELEASED] * 2


@pytest.fixture(scope="module")
def gemma(synthetic_model):
    return synthetic_model("gemma3", "F32")  # window 32 in a 256 context (tests/synthetic.py)


def engines(path, **knobs) -> tuple[Engine, Engine]:
    """(an engine whose sliding layers keep their window, one whose layers keep every token)."""
    config = EngineConfig(threads=1, batch_invariant=True, **knobs)
    capped = Engine(ModelRunner(str(path), config), config)
    every = Engine(ModelRunner(str(path), config, window_capped=False), config)
    assert capped.runner.kv.nbytes < every.runner.kv.nbytes
    return capped, every


def drain(engine: Engine, prompts, params) -> tuple[list[list[int]], int]:
    """Run the prompts together -> (their output tokens, most window-pool blocks in use)."""
    seqs = [engine.requests.make(p, params) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    most = 0
    while engine.has_unfinished:
        engine.step()
        most = max(most, engine.stats().kv_window_blocks_used)
    return [s.output_token_ids for s in seqs], most


def test_generation_with_window_capped_layers_matches_a_cache_that_keeps_everything(gemma):
    # 16-token steps: prompts of 70-90 tokens go in chunks across the window, and 3 sequences
    # of up to 210 tokens slide it ~6 times each
    capped, every = engines(gemma, ctx=256, parallel=3, max_num_batched_tokens=16)
    rng = np.random.default_rng(7)
    vocab = capped.runner.config.vocab_size
    shared = rng.integers(0, vocab, 48).tolist()
    prompts = [shared + rng.integers(0, vocab, n).tolist() for n in (22, 30, 42)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    got, most = drain(capped, prompts, params)
    want, _ = drain(every, prompts, params)
    assert got == want
    # the pool holds 4 blocks a sequence (window 32 + a 16-token step, over 16-token blocks)
    # against the 16 of a 256-token context, and that sufficed: nobody was preempted
    assert capped.scheduler.window_blocks.num_blocks == 3 * 4 and most > 3 * 2
    assert capped.scheduler.num_preemptions == 0
    assert capped.scheduler.blocks.num_hit_tokens > 0  # the shared prefix was reused
    for pool in capped.scheduler.pools:
        assert pool.num_used_blocks == 0 and not pool.tables
    s = capped.stats()  # what `/metrics` and the chat's panel show
    assert (s.kv_window_blocks_used, s.kv_window_blocks_total) == (0, 12)
    assert s.kv_window_blocks_cached > 0 and s.kv_blocks_total == every.stats().kv_blocks_total
    assert every.stats().kv_window_blocks_total == 0


def test_a_second_turn_after_the_window_slid_reuses_the_first_and_gives_the_same_tokens(gemma):
    capped, every = engines(gemma, ctx=256, parallel=2, max_num_batched_tokens=16)
    rng = np.random.default_rng(3)
    first = rng.integers(0, capped.runner.config.vocab_size, 60).tolist()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (reply,), _ = drain(capped, [first], params)
    turn = first + reply + rng.integers(0, capped.runner.config.vocab_size, 9).tolist()
    seq = capped.requests.make(turn, params)
    capped.add(seq)
    while capped.has_unfinished:
        capped.step()
    # the first turn's 100 tokens: 6 full blocks, the last window of them still cached
    assert seq.num_cached_tokens == 96
    (want,), _ = drain(every, [turn], params)
    assert seq.output_token_ids == want


def test_logits_past_the_window_match_llama_cpp(gemma):
    config = EngineConfig(threads=2, ctx=256, parallel=1, max_num_batched_tokens=16)
    engine = Engine(ModelRunner(str(gemma), config), config)
    tokens = np.random.default_rng(1).integers(0, engine.runner.config.vocab_size, 200).tolist()
    ours = [engine.forward(0, tokens[:150])]  # 16-token passes, sliding the window
    ours += [engine.forward(0, [t]) for t in tokens[150:]]
    ours = np.concatenate(ours).astype(np.float64)
    assert engine.scheduler.window_blocks.num_blocks == 4  # 200 tokens went through 4 blocks
    ref = oracle_logits(oracle(gemma, 256), tokens)
    nmse = np.sum((ours - ref) ** 2) / np.sum(ref**2)
    assert nmse <= 1e-4, f"NMSE {nmse:.2e}"
    engine.release(0)
    assert engine.scheduler.window_blocks.num_used_blocks == 0


def test_the_chat_panel_shows_the_window_pool(gemma):
    from test_tui import SHORT, reply_done, run, send

    from edgeinfer.llm import LLM
    from edgeinfer.tui import session as sessions
    from edgeinfer.tui.app import ChatApp, ChatOptions

    llm = LLM(str(gemma), threads=1, ctx=256, parallel=2, max_num_batched_tokens=16)
    pool = llm.engine.window_blocks
    info = sessions.describe(llm, gemma)
    app = ChatApp(ChatOptions(model=str(gemma), params=SHORT), loaded=(llm, info))

    async def script(pilot):
        await send(pilot, "a long enough prompt to slide the window " * 6)
        await reply_done(pilot)
        numbers = str(app.chat.query_one("#numbers").render())
        assert re.search(rf"window\s+0/{pool.num_blocks} blk", numbers), numbers
        assert re.search(rf"KV\s+0/{llm.engine.blocks.num_blocks} blk", numbers)
        assert pool.num_blocks < llm.engine.blocks.num_blocks

    run(app, (100, 30), script)
