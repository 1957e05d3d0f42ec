"""Speculative decoding: the n-gram proposer, adaptive k, and verification inside the engine.

A verified step must give the tokens sequential decoding gives: greedy token for token (bit for
bit in batch-invariant mode), and under sampling the same distribution (chi-square tests).
A logits processor that pushes a fixed script makes the tiny random model copy its prompt, so
drafts are accepted in long runs and a stop lands inside one.
"""

import math
import re

import numpy as np
import pytest

from edgeinfer.config import ConfigError, EngineConfig
from edgeinfer.engine.sampling import Sampler, SamplingParams
from edgeinfer.errors import EdgeInferError
from edgeinfer.llm import LLM
from edgeinfer.speculative import NgramProposer, Speculator
from edgeinfer.speculative.speculator import MAX_PAUSE

SMOL = "smollm2-135m-instruct"

ROOM = 512  # rows a step leaves decoding sequences and their drafts: more than they ask


class Seq:
    """A stand-in decoding sequence: every token but the last computed."""

    def __init__(
        self, seq_id, tokens, max_tokens=None, max_context=1000, prompt_len=None, spec_k=None
    ):
        self.seq_id = seq_id
        self.token_ids = list(tokens)
        self.num_computed = len(tokens) - 1
        self.num_prompt_tokens = len(tokens) if prompt_len is None else prompt_len
        self.max_context = max_context
        self.params = SamplingParams(max_tokens=max_tokens, spec_k=spec_k)

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): 1 - the regularized lower gamma P(df/2, x/2)."""
    a, z = df / 2, x / 2
    term = total = 1 / a
    n = 0
    while term > 1e-15 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return 1 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total


def chi2_two_samples(a: list, b: list, min_expected: float = 5.0) -> float:
    """p-value that two samples of outcomes come from one distribution (rare outcomes pooled)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.count(k) + b.count(k)))
    na, nb, stat, cells = len(a), len(b), 0.0, 0
    rest_a = rest_b = 0
    for k in keys:
        ca, cb = a.count(k), b.count(k)
        if (ca + cb) * min(na, nb) / (na + nb) < min_expected:
            rest_a, rest_b = rest_a + ca, rest_b + cb
            continue
        stat += _cell(ca, cb, na, nb)
        cells += 1
    if rest_a + rest_b:
        stat += _cell(rest_a, rest_b, na, nb)
        cells += 1
    return chi2_sf(stat, cells - 1)


def _cell(ca: int, cb: int, na: int, nb: int) -> float:
    ea, eb = (ca + cb) * na / (na + nb), (ca + cb) * nb / (na + nb)
    return (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb


# -- proposer and pacing, alone ------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(max_n=3, min_n=1)
    seq = Seq(0, [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3])
    # [1, 2, 3] occurred twice before: the latest was followed by 4, 5, 6
    assert p.propose([seq], [2]) == [[4, 5]]
    seq.token_ids += [7]  # 7 never occurred: no n-gram ends in it
    assert p.propose([seq], [4]) == [[]]
    seq.token_ids += [9]  # the index grows with the sequence: a 1-gram match
    assert p.propose([seq], [4]) == [[1, 2, 3, 4]]  # after the latest 9
    seq.token_ids += [9, 1]  # [9, 9, 1] beats the 1-gram [1]
    assert p.propose([seq], [3]) == [[2, 3, 4]]
    p.forget(0)
    assert not p._index


def test_ngram_follows_the_copy_it_is_in_before_a_later_match():
    p = NgramProposer(max_n=3, min_n=1)
    first, later = [10, 1, 2, 3, 4, 5, 6], [11, 2, 3, 4, 9, 9]
    seq = Seq(0, first + later + [10, 1])
    assert p.propose([seq], [2]) == [[2, 3]]  # [10, 1] occurs in the first passage only
    seq.token_ids += [2, 3, 4]  # both accepted, and the model's next token follows the copy
    # [2, 3, 4] last occurred in the later passage, followed by 9, 9: the copy goes on with 5, 6
    assert p.propose([seq], [2]) == [[5, 6]]
    seq.token_ids += [5, 7]  # the copy breaks off: back to the latest match of the last tokens
    assert p.propose([seq], [2]) == [[]]
    seq.token_ids += [11]
    assert p.propose([seq], [2]) == [[2, 3]]
    p.forget(0)
    assert not p._index and not p._copied


def test_only_misses_in_a_row_pause_proposals():
    spec = Speculator(Never(), spec_k=8)
    seq = Seq(0, [1, 2, 3])
    pauses = []
    for _ in range(5):
        assert 0 in spec.drafts([seq], ROOM)
        spec.record(0, 1, 0)
        pauses.append(spec._pace[0].pause)
        while spec._pace[0].pause:
            assert spec.drafts([seq], ROOM) == {}
    assert pauses == [0, 2, 6, 14, 30]
    spec.drafts([seq], ROOM)
    spec.record(0, 1, 1)  # a hit ends the run of misses
    spec.drafts([seq], ROOM)
    spec.record(0, 2, 0)
    assert spec._pace[0].pause == 0


def test_a_draft_with_fewer_than_half_its_tokens_accepted_counts_as_a_miss():
    spec = Speculator(Never(), spec_k=8)
    seq = Seq(0, [1, 2, 3])
    pauses = []
    for proposed, accepted in ((8, 3), (4, 1), (2, 1), (2, 0), (5, 2), (3, 1)):
        assert 0 in spec.drafts([seq], ROOM)
        spec.record(0, proposed, accepted)
        pauses.append(spec._pace[0].pause)
        spec._pace[0].pause = 0  # the next draft at once
    # 3 of 8, then 1 of 4: two misses; 1 of 2 holds half and ends the run; then three misses
    assert pauses == [0, 2, 0, 0, 2, 6]
    assert spec._pace[0].k == 2  # a partly accepted draft still sets k to accepted + 1


class Never:
    """A proposer whose guesses are always rejected."""

    def propose(self, seqs, ks):
        return [[0] * k for k in ks]

    def forget(self, seq_id):
        pass


def test_a_sequence_whose_drafts_always_fail_costs_at_most_5_percent():
    spec = Speculator(Never(), spec_k=8)
    seq, rows = Seq(0, [1, 2, 3]), 0
    steps = 2000
    for _ in range(steps):
        for seq_id, draft in spec.drafts([seq], ROOM).items():
            rows += len(draft)
            spec.record(seq_id, len(draft), 0)
    assert rows / steps <= 0.05
    assert spec._pace[0].pause <= MAX_PAUSE and spec.num_accepted == 0


def test_k_grows_on_acceptance_shrinks_on_rejection_and_respects_limits():
    spec = Speculator(Never(), spec_k=8)
    seq = Seq(0, [1, 2, 3], max_tokens=100)
    assert len(spec.drafts([seq], ROOM)[0]) == 8
    spec.record(0, 8, 2)  # partly accepted: next draft is the accepted length + 1
    assert len(spec.drafts([seq], ROOM)[0]) == 3
    spec.record(0, 3, 3)  # all accepted: doubles, up to spec_k
    assert len(spec.drafts([seq], ROOM)[0]) == 6
    # 2 of 4 output tokens made: a draft of 1 leaves room for its bonus token
    near_end = Seq(1, [1, 2, 3, 5, 5], max_tokens=4, prompt_len=3)
    full_ctx = Seq(2, [1, 2, 3], max_context=5)
    prompt = Seq(3, [1, 2, 3])
    prompt.num_computed = 1  # still in prefill: no draft
    got = spec.drafts([near_end, full_ctx, prompt], ROOM)
    assert {k: len(v) for k, v in got.items()} == {1: 1, 2: 2}


def test_drafts_fill_a_step_up_to_the_rows_left_them():
    spec = Speculator(Never(), spec_k=8)
    for n, k in ((1, 8), (4, 3), (8, 1), (16, 0)):
        seqs = [Seq(i, [1, 2, 3]) for i in range(n)]
        got = spec.drafts(seqs, room=16)
        assert [len(got.get(s.seq_id, [])) for s in seqs] == [k] * n, n


def test_a_requests_spec_k_caps_its_drafts_and_0_turns_them_off():
    spec = Speculator(Never(), spec_k=4)
    seqs = [Seq(0, [1, 2, 3]), Seq(1, [1, 2, 3], spec_k=0), Seq(2, [1, 2, 3], spec_k=3)]
    seqs.append(Seq(3, [1, 2, 3], spec_k=20))  # more than the engine's: the engine's
    got = spec.drafts(seqs, ROOM)
    assert {k: len(v) for k, v in got.items()} == {0: 4, 2: 3, 3: 4}
    spec.record(2, 3, 3)  # all accepted: k doubles, but the request's cap holds
    assert len(spec.drafts(seqs, ROOM)[2]) == 3
    for bad in (-1, 1.5, True):
        with pytest.raises(EdgeInferError, match="spec_k"):
            SamplingParams(spec_k=bad)


def test_config_validates_the_speculative_knobs():
    assert EngineConfig(speculative="ngram", spec_k=4).step_logit_rows == min(64 * 5, 512)
    for bad in ({"speculative": "eagle"}, {"spec_k": 0}, {"spec_k": 99}):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)


# -- the sampler's acceptance rule ---------------------------------------------------------


def test_verify_keeps_the_sampled_distribution():
    logits = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1], np.float32))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    p = np.exp(logits) / np.exp(logits).sum()
    n = 20000
    for guess in (1, 3):
        s = Sampler(params)
        got = np.bincount([s.verify(logits, [], 0, guess)[0] for _ in range(n)], minlength=5)
        stat = float(((got - n * p) ** 2 / (n * p)).sum())
        assert chi2_sf(stat, 4) > 1e-3, (guess, got)
    s = Sampler(SamplingParams(temperature=0))
    assert s.verify(logits, [], 0, 1) == (1, True) and s.verify(logits, [], 0, 2) == (1, False)


# -- inside the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def synth(synthetic_model):
    return synthetic_model("llama", "F32")


def script_processor(script: list[int], push: float):
    """A logits processor that makes script[i] the model's favourite i-th output token, by
    `push` over the model's own favourite."""

    def process(output, logits):
        if len(output) < len(script):
            logits[script[len(output)]] = logits.max() + push
        return logits

    return process


def run(path, prompts, params, **knobs):
    llm = LLM(str(path), threads=1, max_num_batched_tokens=64, **knobs)
    return llm.generate(prompts, params), llm.stats()


def same(a, b):
    return [(c.token_ids, c.text, c.finish_reason) for c in a] == [
        (c.token_ids, c.text, c.finish_reason) for c in b
    ]


@pytest.mark.parametrize(
    "mode",
    [{"batch_invariant": True}, {"precision": "exact"}, {}],
    ids=["invariant", "exact", "fast"],
)
def test_greedy_is_token_for_token_the_output_without_speculation(synth, mode):
    rng = np.random.default_rng(0)
    phrase = rng.integers(300, 400, 12).tolist()
    # copy-prone, random and short prompts in one batch: some steps verify drafts for some
    # sequences only; penalties see the accepted tokens
    prompts = [phrase * 4, rng.integers(0, 500, 30).tolist(), phrase * 2 + [5, 6], [7]]
    params = [
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
    ]
    base, _ = run(synth, prompts, params, **mode)
    got, stats = run(synth, prompts, params, **mode, speculative="ngram", spec_k=6)
    assert same(base, got)
    lp = [[t.logprob for t in c.logprobs or ()] for c in (base[3], got[3])]
    if mode:  # the same bits
        assert got[3].logprobs == base[3].logprobs
    else:  # a verify step's rows may take other kernels than one-row decode: rounding differs
        np.testing.assert_allclose(lp[0], lp[1], atol=1e-4)
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens  # both outcomes ran
    assert stats.kv_blocks_used == 0 and stats.generated_tokens == sum(
        len(c.token_ids) for c in base
    )


def test_speculation_is_off_for_a_request_that_asks_and_on_for_its_batch_mates(synth):
    phrase = np.random.default_rng(2).integers(300, 400, 12).tolist()
    # one step computes both prompts (max_num_batched_tokens 64), so the batch's decode steps
    # are the first request's steps alone, none of them beside a prompt chunk (no drafts there)
    prompts = [phrase * 2, phrase * 2 + [9]]
    # both replies copy the phrase (the random model's own would repeat no two tokens of it)
    copy = dict(ignore_eos=True, logits_processors=[script_processor(phrase * 5, 50.0)])
    on = SamplingParams(temperature=0, max_tokens=50, **copy)
    off = SamplingParams(temperature=0, max_tokens=50, spec_k=0, **copy)
    base, _ = run(synth, prompts, on)
    knobs = dict(speculative="ngram", spec_k=6)
    got, both = run(synth, prompts, [on, off], **knobs)
    assert same(base, got)
    _, alone_on = run(synth, prompts[:1], on, **knobs)
    _, alone_off = run(synth, prompts[1:], off, **knobs)
    assert alone_off.spec_proposed_tokens == alone_off.spec_drafts == 0
    # the batch's drafts are all the first request's, as many as it makes alone
    assert alone_on.spec_proposed_tokens > 0
    counts = ("spec_drafts", "spec_proposed_tokens", "spec_accepted_tokens")
    assert [getattr(both, c) for c in counts] == [getattr(alone_on, c) for c in counts]


def test_stops_inside_an_accepted_run_end_where_sequential_decoding_ends(synth):
    phrase = [310, 320, 330, 340, 350, 360, 370, 380, 390]
    script = phrase * 6  # the prompt is the phrase twice: its continuation is fully drafted
    copy = script_processor(script, 50.0)
    base_params = SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=40, logits_processors=[copy], logprobs=1
    )
    base, _ = run(synth, [phrase * 2], base_params)
    text = base[0].text
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    params = [
        base_params,
        SamplingParams(temperature=0, max_tokens=13, logits_processors=[copy]),
        SamplingParams(temperature=0, stop_token_ids=[360], logits_processors=[copy]),
        SamplingParams(temperature=0, stop=stop_text, logits_processors=[copy], logprobs=0),
    ]
    want, _ = run(synth, [phrase * 2] * 4, params, prefix_caching=False)
    got, stats = run(synth, [phrase * 2] * 4, params, speculative="ngram", spec_k=8)
    assert base[0].token_ids == script[:40]
    assert same(want, got)
    assert [len(c.token_ids) for c in got][1:3] == [13, 6]
    assert got[3].finish_reason == "stop" and stop_text not in got[3].text
    assert [len(c.logprobs) for c in got if c.logprobs] == [40, len(want[3].token_ids)]
    # the copy was drafted: most steps of the first request verified several tokens
    assert stats.spec_accepted_tokens >= 40 and stats.kv_blocks_used == 0


def test_sampling_with_speculation_keeps_the_output_distribution(synth):
    """Chi-square over seeded draws of a 4-token continuation, with and without drafts that
    the sampler accepts about 2 times in 3 (a script pushed by a finite margin)."""
    phrase = [310, 320, 330, 340]
    push = script_processor(phrase * 3, 0.5)
    prompt = phrase * 3
    n = 400

    def draws(**knobs):
        params = [
            SamplingParams(
                temperature=1.0,
                top_k=4,
                top_p=1.0,
                min_p=0.0,
                max_tokens=4,
                seed=s,
                ignore_eos=True,
                logits_processors=[push],
            )  # fmt: skip
            for s in range(n)
        ]
        out, stats = run(synth, [prompt] * n, params, max_num_seqs=4, **knobs)
        return [tuple(c.token_ids) for c in out], stats

    plain, _ = draws()
    spec, stats = draws(speculative="ngram", spec_k=2)
    assert 0.3 < stats.spec_acceptance_rate < 0.95
    assert chi2_two_samples(plain, spec) > 1e-3
    for i in range(1, 4):  # each position's marginal: the joint has too many cells for power
        assert chi2_two_samples([t[i] for t in plain], [t[i] for t in spec]) > 1e-3, i
    # the test can tell: a rule that always keeps the guess is caught
    assert plain.count(tuple(phrase)) < 0.8 * n


def test_the_real_model_copies_with_drafts_and_keeps_its_greedy_output(real_model):
    path = real_model(SMOL)
    code = (
        "def area(r):\n    return 3.14159 * r * r\n\n\n"
        "def perimeter(r):\n    return 2 * 3.14159 * r\n"
    )
    msgs = [{"role": "user", "content": f"Rewrite this code, renaming r to radius:\n\n{code}"}]
    params = SamplingParams(temperature=0, max_tokens=48)
    for knobs in ({"batch_invariant": True, "spec_k": 8}, {"spec_k": 5}):
        (want,) = LLM(str(path), threads=1, **knobs).chat(msgs, params)
        spec = LLM(str(path), threads=1, speculative="ngram", **knobs)
        (got,) = spec.chat(msgs, params)
        assert got.token_ids == want.token_ids, knobs
        s = spec.stats()
        assert s.spec_acceptance_rate > 0.3 and s.spec_mean_accepted > 1, s


def test_a_k_quant_verify_pass_gives_each_row_the_bits_of_a_one_token_step(synthetic_model):
    # a Q4_K_M file's fused kernels take every verify pass of up to 8 rows (spec_k 6 makes 7),
    # each row computed as a one-token step computes it: the same tokens and log-probabilities
    path = synthetic_model("llama", "Q4_K_M")
    phrase = np.random.default_rng(3).integers(300, 400, 12).tolist()
    # the reply copies the phrase (drafts accepted), then goes its own way (drafts rejected)
    script = dict(logits_processors=[script_processor(phrase * 2, 50.0)])
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2, **script)
    (want,), _ = run(path, [phrase * 3], [params])
    (got,), stats = run(path, [phrase * 3], [params], speculative="ngram", spec_k=6)
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens


# -- a draft model ---------------------------------------------------------------------------


def test_a_draft_model_keeps_greedy_output_and_its_cache_is_freed(synth, synthetic_model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 500, n).tolist() for n in (5, 30, 70)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, _ = run(synth, prompts, params, batch_invariant=True)
    # the same weights in Q8_0 guess well; another architecture on the same vocabulary does not
    for draft, least in (("llama", 0.7), ("qwen3", 0.0)):
        path = synthetic_model(draft, "Q8_0" if draft == "llama" else "F32")
        llm = LLM(str(synth), threads=1, batch_invariant=True, speculative=f"draft:{path}")
        got = llm.generate(prompts, params)
        assert same(want, got), draft
        s = llm.stats()
        assert s.spec_proposed_tokens > 0 and s.spec_acceptance_rate >= least, (draft, s)
        assert llm.engine.speculator.proposer.blocks.num_used_blocks == 0
        assert "\ndraft model KV cache: 64 blocks" in llm.kv_report()  # as many as the target


def patched(src, tmp_path, old: bytes, new: bytes):
    """A copy of a GGUF file with one run of bytes replaced by another of the same length."""
    data = src.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    out = tmp_path / f"patched-{len(list(tmp_path.iterdir()))}.gguf"
    out.write_bytes(data.replace(old, new))
    return out


def test_a_draft_model_with_another_vocabulary_is_refused_clearly(synth, synthetic_model, tmp_path):
    key = b"tokenizer.ggml.eos_token_id"
    data = synth.read_bytes()
    at = data.index(key) + len(key) + 4  # the key, its value type, then its value
    eos = data[at - 4 - len(key) : at + 4]
    bad_eos = patched(synth, tmp_path, eos, eos[:-4] + bytes([eos[-4] + 1]) + eos[-3:])
    renamed = patched(synth, tmp_path, "\u2581quick".encode(), "\u2581quack".encode())
    gemma = synthetic_model("gemma3", "F32")
    for draft, needle in (
        (bad_eos, "tokenizer.ggml.eos_token_id is 3, the target's is 2"),
        (renamed, "is '\u2581quack', the target's is '\u2581quick'"),
        (gemma, "626 tokens, the target has 625"),
    ):
        with pytest.raises(EdgeInferError, match=re.escape(needle)):
            LLM(str(synth), speculative=f"draft:{draft}")
