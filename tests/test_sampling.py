"""The sampler: llama.cpp's own sampler chain (through llama-cpp-python) is the oracle for the
penalties and the top-k / top-p / min-p sets; draws are checked empirically with fixed seeds."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from edgeinfer.engine.sampling import (
    Sampler,
    SamplingParams,
    SamplingParamsError,
    apply_penalties,
    candidates,
)
from edgeinfer.errors import EdgeInferError

llama_cpp = pytest.importorskip("llama_cpp")


def _logits(seed: int, vocab: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def llama_chain(logits: np.ndarray, history, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's penalties -> top-k -> top-p -> min-p on logits: (surviving ids, their logits)."""
    vocab = logits.shape[0]
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for s in (
        llama_cpp.llama_sampler_init_penalties(
            vocab, p.repeat_last_n, p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        ),
        llama_cpp.llama_sampler_init_top_k(p.top_k),
        llama_cpp.llama_sampler_init_top_p(p.top_p, 0),
        llama_cpp.llama_sampler_init_min_p(p.min_p, 0),
    ):
        llama_cpp.llama_sampler_chain_add(chain, s)
    try:
        for t in history:
            llama_cpp.llama_sampler_accept(chain, int(t))
        data = (llama_cpp.llama_token_data * vocab)()
        for i, v in enumerate(logits.tolist()):
            data[i] = llama_cpp.llama_token_data(i, v, 0.0)
        arr = llama_cpp.llama_token_data_array(data, vocab, -1, False)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
        out = [arr.data[i] for i in range(arr.size)]
    finally:
        llama_cpp.llama_sampler_free(chain)
    ids = np.array([d.id for d in out], dtype=np.int64)
    return ids, np.array([d.logit for d in out], dtype=np.float32)


PENALTY_CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(presence_penalty=0.7, frequency_penalty=-0.2, repeat_last_n=16),
    SamplingParams(repetition_penalty=1.1, presence_penalty=0.3, repeat_last_n=0),
]


@pytest.mark.parametrize("p", PENALTY_CASES, ids=range(len(PENALTY_CASES)))
def test_penalties_match_llama_cpp(p):
    vocab = 300
    logits = _logits(1, vocab)
    # repeated tokens, both signs of logit, more history than repeat_last_n
    history = np.random.default_rng(2).integers(0, 60, size=150).tolist()
    ours = apply_penalties(logits, history, p)
    off = SamplingParams(top_k=0, top_p=1.0, min_p=0.0, **_penalties(p))
    ids, theirs = llama_chain(logits, history, off)
    full = np.empty(vocab, np.float32)
    full[ids] = theirs
    assert len(ids) == vocab
    np.testing.assert_array_equal(ours, full)
    if p.penalized:
        assert not np.array_equal(ours, logits)


def _penalties(p: SamplingParams) -> dict:
    return dict(
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repeat_last_n=p.repeat_last_n,
    )


def test_penalty_window_is_last_n_tokens():
    logits = np.full(10, 2.0, np.float32)
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, repeat_last_n=3)
    out = apply_penalties(logits, [1, 1, 1, 2, 2, 3], p)
    # window [2, 2, 3]: token 1 fell out of it
    assert out[1] == 2.0
    assert out[2] == pytest.approx(2.0 / 2 - 2 * 0.25)
    assert out[3] == pytest.approx(2.0 / 2 - 0.25)
    whole = apply_penalties(
        logits, [1, 1, 1, 2], SamplingParams(presence_penalty=1.0, repeat_last_n=-1)
    )
    assert whole[1] == whole[2] == 1.0
    neg = apply_penalties(np.full(4, -1.0, np.float32), [0], SamplingParams(repetition_penalty=1.5))
    assert neg[0] == pytest.approx(-1.5)  # a negative logit is multiplied: less likely, too


FILTER_CASES = [
    dict(top_k=5, top_p=1.0, min_p=0.0),
    dict(top_k=0, top_p=0.5, min_p=0.0),
    dict(top_k=0, top_p=1.0, min_p=0.2),
    dict(top_k=40, top_p=0.95, min_p=0.05),  # llama.cpp's defaults
    dict(top_k=200, top_p=0.9, min_p=0.01),
    dict(top_k=-1, top_p=0.99, min_p=0.0),
    dict(top_k=3, top_p=0.1, min_p=0.9),
]


@pytest.mark.parametrize("vocab", [257, 5000])
@pytest.mark.parametrize("case", FILTER_CASES, ids=[str(c) for c in FILTER_CASES])
def test_candidate_set_matches_llama_cpp(case, vocab):
    for seed in range(3):
        logits = _logits(seed, vocab, scale=1.0 + seed)
        p = SamplingParams(**case)
        expected, _ = llama_chain(logits, [], p)
        got = candidates(logits, p)
        assert sorted(got.tolist()) == sorted(expected.tolist())


def test_top_p_wide_fallback_on_large_vocab():
    # a flat distribution over 262k tokens: the best 256 / 16384 do not reach p
    logits = _logits(7, 262144, scale=0.5)
    p = SamplingParams(top_k=0, top_p=0.3, min_p=0.0)
    got = candidates(logits, p)
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    probs = np.exp(logits[order] - logits.max()).astype(np.float64)
    cum = np.cumsum(probs / probs.sum())
    n = int(np.searchsorted(cum, 0.3)) + 1
    assert got.size > 16384
    assert abs(got.size - n) <= 1  # float32 vs float64 running sums at the boundary
    assert set(got.tolist()) <= set(order[: n + 1].tolist())


def _draws(logits, p, n):
    s = Sampler(p)
    return np.array([s(logits, []) for _ in range(n)])


@pytest.mark.parametrize("case", FILTER_CASES, ids=[str(c) for c in FILTER_CASES])
def test_draws_stay_in_allowed_set(case):
    logits = _logits(11, 2000, scale=2.0)
    p = SamplingParams(**case, temperature=1.5, seed=3)
    allowed, _ = llama_chain(logits, [], p)
    draws = _draws(logits, p, 1500)
    assert set(draws.tolist()) <= set(allowed.tolist())
    # and the sampler really explores the set (not just the argmax)
    if allowed.size >= 3:
        assert len(set(draws.tolist())) >= min(3, allowed.size)


def test_draw_frequencies_follow_temperature():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    for temp in (1.0, 0.5, 2.0):
        p = SamplingParams(temperature=temp, top_k=0, top_p=1.0, min_p=0.0, seed=42)
        counts = np.bincount(_draws(logits, p, 8000), minlength=4) / 8000
        w = probs ** (1 / temp)
        np.testing.assert_allclose(counts, w / w.sum(), atol=0.02)


def test_top_p_and_min_p_renormalize_survivors():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=5)
    counts = np.bincount(_draws(logits, p, 8000), minlength=4) / 8000
    np.testing.assert_allclose(counts, [0.625, 0.375, 0, 0], atol=0.02)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25, seed=5)
    counts = np.bincount(_draws(logits, p, 8000), minlength=4) / 8000
    np.testing.assert_allclose(counts, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.02)


def test_greedy_is_argmax_of_penalized_logits():
    for seed in range(20):
        logits = _logits(seed, 1000)
        assert Sampler(SamplingParams(temperature=0))(logits, []) == int(np.argmax(logits))
    logits = np.array([1.0, 3.0, 2.9], np.float32)
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert Sampler(p)(logits, [1]) == 2  # 3.0 / 1.5 = 2.0 < 2.9


def test_same_seed_same_tokens_different_seed_differs():
    logits = _logits(3, 4000, scale=1.0)
    p = SamplingParams(seed=1234, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a, b = _draws(logits, p, 200), _draws(logits, p, 200)
    c = _draws(
        logits, SamplingParams(seed=1235, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), 200
    )
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    unseeded = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert _draws(logits, unseeded, 200).tolist() != _draws(logits, unseeded, 200).tolist()


BAD = [
    dict(temperature=-0.1),
    dict(temperature=math.nan),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(min_p=-0.1),
    dict(min_p=1.1),
    dict(top_k=-2),
    dict(top_k=2.5),
    dict(repetition_penalty=0.0),
    dict(presence_penalty=math.inf),
    dict(frequency_penalty="1"),
    dict(repeat_last_n=-5),
    dict(seed=-1),
    dict(seed=1.5),
    dict(max_tokens=0),
    dict(stop=[""]),
    dict(stop=["ok", 3]),
    dict(stop_token_ids=[-1]),
    dict(ignore_eos="yes"),
]


@pytest.mark.parametrize("kwargs", BAD, ids=[str(k) for k in BAD])
def test_bad_params_raise_one_line_error(kwargs):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, EdgeInferError)
    (name,) = kwargs
    msg = str(e.value)
    assert msg.startswith(name) and "\n" not in msg


def test_params_normalize_stop_lists():
    p = SamplingParams(stop="###", stop_token_ids=[np.int64(7)])
    assert p.stop == ("###",) and p.stop_token_ids == (7,)
    assert SamplingParams().stop == () and SamplingParams(temperature=0).greedy
