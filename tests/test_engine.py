"""The continuous-batching engine on real forward passes: batches give each request the tokens
it gets alone, aborts and preemption free everything, prefixes are reused, priorities hold."""

import numpy as np
import pytest

from edgeinfer.engine.memory_plan import kv_block_bytes, step_bytes
from edgeinfer.engine.requests import RequestTooLargeError
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.llm import LLM
from edgeinfer.models import base

SMOL = "smollm2-135m-instruct"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(vocab: int, lengths, seed=0) -> list[list[int]]:
    """Token-id prompts, half of them behind a shared prefix."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 40).tolist()  # a common prefix, as a system prompt would be
    out = []
    for i, n in enumerate(lengths):
        own = rng.integers(0, vocab, n).tolist()
        out.append(shared + own if i % 2 else own)
    return out


def alone(path, batch, params=GREEDY) -> list[list[int]]:
    """Each prompt on its own, on a fresh model with no prefix cache."""
    llm = LLM(str(path), threads=1, prefix_caching=False, batch_invariant=True)
    return [llm.generate(p, params)[0].token_ids for p in batch]


def block_bytes(path) -> int:
    """One f16 KV block of the model, as the runner sizes its budget."""
    with read_gguf(path) as g:
        return kv_block_bytes(ModelConfig.from_gguf(g), "f16")


@pytest.fixture(scope="module")
def synth(synthetic_model):
    return synthetic_model("llama", "F32")


def test_a_batch_gives_each_request_its_tokens_alone(synth):
    llm = LLM(str(synth), threads=1, max_num_batched_tokens=64, batch_invariant=True)
    batch = prompts(llm.config.vocab_size, [3, 50, 9, 70, 1, 33])
    got = [c.token_ids for c in llm.generate(batch, GREEDY)]
    assert got == alone(synth, batch)
    s = llm.stats()
    assert s.prefix_cache_hit_tokens > 0  # the shared prefix was reused in the batch
    assert s.running == s.waiting == s.kv_blocks_used == 0


def test_the_real_model_batched_matches_alone(real_model):
    path = real_model(SMOL)
    llm = LLM(str(path), threads=1, batch_invariant=True)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 8]
    ids = [llm.tokenizer.encode(t) for t in texts] + [
        llm.chat_token_ids([{"role": "user", "content": "Name three colours."}])
    ]
    got = [c.token_ids for c in llm.generate(ids, GREEDY)]
    assert got == alone(path, ids)


def test_preemption_under_a_tiny_kv_budget_still_gives_the_same_tokens(synth):
    block = block_bytes(synth)
    # 96 tokens for 4 requests of 40
    llm = LLM(str(synth), threads=1, kv_budget=6 * block, batch_invariant=True)
    batch = prompts(llm.config.vocab_size, [20, 20, 20, 20], seed=1)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = [c.token_ids for c in llm.generate(batch, params)]
    assert llm.stats().preemptions > 0
    assert got == alone(synth, batch, params)
    assert llm.kv_usage()[0] == 0


def test_a_request_that_could_never_fit_is_refused_at_admission(synth):
    block = block_bytes(synth)
    llm = LLM(str(synth), threads=1, kv_budget=2 * block)  # 32 tokens
    with pytest.raises(RequestTooLargeError, match="KV cache holds 32 tokens"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=30))
    assert llm.generate([[1] * 10], SamplingParams(max_tokens=5))[0].finish_reason == "length"


def engine_with(synth, **kw):
    llm = LLM(str(synth), threads=1, **kw)
    return llm, llm.engine


def new_seq(llm, ids, params=GREEDY, priority=0):
    return llm.requests.make(ids, params, priority=priority)


def test_abort_during_prefill_and_during_decode_frees_every_block(synth):
    llm, engine = engine_with(synth, max_num_batched_tokens=16)
    blocks = engine.blocks
    seq = new_seq(llm, list(range(1, 61)))
    engine.add(seq)
    engine.step()  # the first 16-token chunk
    assert 0 < seq.num_computed < 60 and blocks.num_used_blocks > 0
    seq.aborted = True  # as another thread would
    assert engine.step() == [(seq, "")]
    assert seq.finish_reason == "abort" and blocks.num_used_blocks == 0 and not blocks.tables

    seq = new_seq(llm, list(range(1, 10)))
    engine.add(seq)
    for _ in range(3):
        engine.step()
    assert seq.num_output_tokens == 3
    engine.abort(seq)
    assert seq.finish_reason == "abort" and blocks.num_used_blocks == 0
    assert not engine.has_unfinished


def test_a_second_chat_turn_reuses_the_first_turns_blocks(real_model):
    # batch-invariant: every position takes the row-wise kernels whether it was computed in the
    # first turn (and cached) or recomputed, so both must give the same reply bit for bit
    llm = LLM(str(real_model(SMOL)), threads=1, batch_invariant=True)
    history = [{"role": "user", "content": "What is the capital of France?"}]
    first = llm.chat(history, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    history += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = llm.stream_chat(history, GREEDY)
    text = "".join(second)
    reused = second.sequence.num_cached_tokens
    # everything up to the last full block of the first turn's prompt and reply
    assert reused >= (first.metrics.prompt_tokens + len(first.token_ids) - 16) // 16 * 16 - 16
    assert reused > 0 and second.completion.metrics.cached_tokens == reused
    fresh = LLM(str(real_model(SMOL)), threads=1, prefix_caching=False, batch_invariant=True)
    assert "".join(fresh.stream_chat(history, GREEDY)) == text


def test_higher_priority_finishes_first_and_the_preempted_one_is_unchanged(synth):
    llm, engine = engine_with(synth, max_num_seqs=1, batch_invariant=True)
    low = new_seq(llm, [5, 6, 7], priority=0)
    engine.add(low)
    engine.step()
    engine.step()
    high = new_seq(llm, [8, 9, 10], priority=1)
    engine.add(high)
    order = []
    while engine.has_unfinished:
        order += [s for s, _ in engine.step() if s.finished]
    assert order == [high, low] and engine.stats().preemptions == 1
    assert low.output_token_ids == alone(synth, [[5, 6, 7]])[0]


def test_the_runner_plans_a_steps_logits_for_max_num_seqs(synth):
    llm = LLM(str(synth), threads=1, parallel=1, max_num_seqs=8, max_num_batched_tokens=64)
    with read_gguf(synth) as g:
        assert llm._runner.step_bytes == step_bytes(ModelConfig.from_gguf(g), 64, 8)
    assert "step buffers" in llm.kv_report() and "logits of 8" in llm.kv_report()


def test_a_sequences_logits_do_not_depend_on_its_batch_mates(synth):
    """Bit for bit: decode alone, decode next to other sequences, and the same token computed
    inside a prompt chunk (as after a preemption) give the same logits."""
    engine = LLM(str(synth), threads=2).engine
    scheduler = engine.scheduler

    def execute(*work):  # (seq_id, token ids, wants logits) -> one row-wise step
        chunks = []
        for seq_id, ids, wants in work:
            chunk = scheduler.extend(seq_id, ids, scheduler.seq_len(seq_id))
            chunk.wants_logits = wants
            chunks.append(chunk)
        return engine.runner.execute(chunks, row_wise=True)

    ids = prompts(engine.runner.config.vocab_size, [240], seed=3)[0][:240]  # past a split chunk
    execute((0, ids[:-1], False))
    alone = execute((0, ids[-1:], True))[0]
    execute((1, ids[:-1], False), (2, ids[:20], False), (3, ids[:5], False))
    together = execute((2, [7], True), (1, ids[-1:], True), (3, [9], True))[1]
    in_chunk = execute((4, ids, True))[0]
    assert np.array_equal(alone, together)
    assert np.array_equal(alone, in_chunk)


@pytest.mark.parametrize(
    "arch, ftype",
    [
        ("llama", "Q4_K_M"),
        ("gemma3", "Q8_0"),
        ("qwen2", "Q5_1"),
        ("llama", "F16"),
        ("gemma3", "F32"),
    ],
)
def test_a_prompts_ffn_in_pieces_keeps_every_bit(synthetic_model, monkeypatch, arch, ftype):
    """A prompt step computes the FFN's gate and up a range of columns at a time (its peak of
    memory); in every kernel mode the logits are those of one [gate | up] matmul, bit for bit."""
    monkeypatch.setattr(base, "FFN_PIECE_COLS", 192)  # 512 columns: 192 + 192 + 128
    engine = LLM(str(synthetic_model(arch, ftype)), threads=2).engine
    assert len(engine.runner.model.layers[0].gate_up_pieces) == 3
    ids = prompts(engine.runner.config.vocab_size, [80], seed=5)[0]
    assert len(ids) >= base.FFN_PIECES_FROM
    seq_ids = iter(range(100))

    def logits(row_wise) -> np.ndarray:
        chunk = engine.scheduler.extend(next(seq_ids), ids, 0)
        chunk.wants_logits = True
        return engine.runner.execute([chunk], row_wise=row_wise)[0]

    modes = (base.ROW_WISE_INT8, base.ROW_WISE_EXACT, True)
    in_pieces = [logits(mode) for mode in modes]
    monkeypatch.setattr(base, "FFN_PIECES_FROM", 1 << 30)
    for mode, got in zip(modes, in_pieces, strict=True):
        assert np.array_equal(got, logits(mode)), mode


def test_random_traffic_under_a_small_budget_always_drains(synth):
    """Arrivals mid-run, mixed priorities, aborts and constant preemption: every request ends
    in bounded steps and every block comes back."""
    block = block_bytes(synth)
    llm, engine = engine_with(synth, kv_budget=8 * block, max_num_seqs=4, max_num_batched_tokens=24)
    rng = np.random.default_rng(7)
    vocab = llm.config.vocab_size
    pending = [
        new_seq(
            llm,
            rng.integers(0, vocab, int(rng.integers(1, 60))).tolist(),
            SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 40)), ignore_eos=True),
            priority=int(rng.integers(0, 3)),
        )
        for _ in range(30)
    ]
    seqs = list(pending)
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            engine.add(pending.pop())
        if engine.has_unfinished and rng.random() < 0.02:
            victim = rng.choice(engine.scheduler.running + engine.scheduler.waiting)
            victim.aborted = True
        engine.step()
        if not pending and not engine.has_unfinished:
            break
    assert not pending and not engine.has_unfinished, "still busy after 3000 steps"
    assert all(s.finished for s in seqs)
    assert engine.stats().preemptions > 0
    assert engine.blocks.num_used_blocks == 0 and not engine.blocks.tables
    done = [s for s in seqs if s.finish_reason == "length"]
    assert done and all(s.num_output_tokens == s.params.max_tokens for s in done)
