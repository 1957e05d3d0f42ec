"""Logits of every architecture against llama.cpp (llama-cpp-python) on the same GGUF file.

Synthetic models: every architecture x every ftype, logits NMSE <= 1e-2, with the prompt fed
as a prefill followed by single-token decode steps (so the paged cache is read back).
Real models: mean KL(llama.cpp || edgeinfer) and top-1 agreement over several prompts
(>= 256 positions), bounded by 1e-3 / 98 % or by llama.cpp's disagreement with itself (batched
against one token at a time, f16 against f32 KV; with a margin) where that floor is higher;
greedy continuations agree until a near-tie.
Both sides use a float16 KV cache. Also: evaluation passes' error handling and chunking.
"""

from __future__ import annotations

import numpy as np
import pytest
from llama_oracle import F32, PROMPTS, kl, oracle, oracle_logits

from edgeinfer.errors import EdgeInferError
from edgeinfer.llm import LLM

llama_cpp = pytest.importorskip("llama_cpp")

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
FTYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0",
    "Q4_K_M", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K",
)  # fmt: skip
N_SYNTH = 48  # > the synthetic gemma3's sliding window (32), so the window matters
N_PREFILL = 40
NMSE_MAX = 1e-2
KL_MAX = 1e-3
TOP1_MIN = 0.98
NOISE_MARGIN = 1.5  # allowed multiple of llama.cpp's disagreement with itself
TOP1_SLACK = 0.03
# Greedy continuations are compared until llama.cpp's top-2 logit gap drops below this. Single
# logits differ by up to ~1 between llama.cpp and itself with f16 vs f32 KV on these models
# (see test_real_model_logits), so a smaller gap is a tie within the oracle's own noise.
NEAR_TIE = 1.0
GREEDY_STEPS = 32
MIN_GREEDY_COMPARED = 16  # over all greedy prompts, so the check is never vacuous
# Prompts with confident continuations, so greedy decoding runs long before a near-tie.
GREEDY_PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
]


@pytest.mark.parametrize("ftype", FTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_synthetic_parity(synthetic_model, arch, ftype):
    path = synthetic_model(arch, ftype)
    llm = LLM(str(path), threads=2, ctx=64)
    tokens = np.random.default_rng(1).integers(0, llm.config.vocab_size, N_SYNTH).tolist()
    ours = [llm.engine.forward(0, tokens[:N_PREFILL])]
    ours += [llm.engine.forward(0, [t]) for t in tokens[N_PREFILL:]]
    ours = np.concatenate(ours).astype(np.float64)
    ref = oracle_logits(oracle(path, 64), tokens)
    nmse = np.sum((ours - ref) ** 2) / np.sum(ref**2)
    assert nmse <= NMSE_MAX, f"{arch} {ftype}: NMSE {nmse:.2e}"


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def real_pair(request, real_model):
    path = real_model(request.param)
    return request.param, LLM(str(path), threads=2, ctx=512).engine, oracle(path, 512)


def test_real_model_logits(real_pair, real_model):
    """KL and top-1 agreement against llama.cpp, judged against llama.cpp's own noise floor.

    Small models amplify rounding, and llama.cpp does not agree with itself to 1e-3: on these
    prompts its logits computed one token at a time (n_batch = 1, its decode path) differ from
    its batched ones by a mean KL of ~2.3e-3 / top-1 98.1 % (SmolLM2 135M) and ~4.7e-3 / 94.9 %
    (Gemma 3 270M), and with only the KV cache precision changed (f16 -> f32) by ~3.5e-3 and
    ~6e-3. An implementation that is not bit-identical to llama.cpp's batched kernels (its int8
    activation quantization, f16 rounding of Q and of softmax weights) cannot get under that
    floor, so the bounds are KL_MAX / TOP1_MIN or the floor (with a margin), whichever is
    looser; the floor is measured here, on the same prompts: the larger disagreement of the two.
    """
    name, engine, llm = real_pair
    path = str(real_model(name))
    others = {
        "f32 KV": oracle(path, 512, type_k=F32, type_v=F32),
        "one token at a time": oracle(path, 512, n_batch=1, n_ubatch=1),
    }
    kls, agree = [], []
    floor_kls = {k: [] for k in others}
    floor_agree = {k: [] for k in others}
    for i, text in enumerate(PROMPTS):
        tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
        ref = oracle_logits(llm, tokens)
        ours = engine.forward(100 + i, tokens)
        engine.release(100 + i)
        kls.append(kl(ref, ours))
        agree.append(ref.argmax(-1) == ours.argmax(-1))
        for key, other_llm in others.items():
            other = oracle_logits(other_llm, tokens)
            floor_kls[key].append(kl(ref, other))
            floor_agree[key].append(ref.argmax(-1) == other.argmax(-1))
    kls, agree = np.concatenate(kls), np.concatenate(agree)
    floors = {
        k: (np.concatenate(floor_kls[k]).mean(), np.concatenate(floor_agree[k]).mean())
        for k in others
    }
    floor_kl = max(f[0] for f in floors.values())
    floor_top1 = min(f[1] for f in floors.values())
    assert kls.size >= 256
    print(
        f"{name}: {kls.size} positions, mean KL {kls.mean():.2e} (median {np.median(kls):.1e}), "
        f"top-1 {agree.mean():.2%}; llama.cpp against itself: "
        + "; ".join(f"{k}: KL {f[0]:.2e}, top-1 {f[1]:.2%}" for k, f in floors.items())
    )
    assert kls.mean() <= max(KL_MAX, NOISE_MARGIN * floor_kl)
    assert agree.mean() >= min(TOP1_MIN, floor_top1 - TOP1_SLACK)


def test_real_model_greedy(real_pair):
    name, engine, llm = real_pair
    total = 0
    for i, text in enumerate(GREEDY_PROMPTS):
        tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(tokens)
        ours = engine.forward(200 + i, tokens)[-1]
        compared = 0
        for _ in range(GREEDY_STEPS):
            ref = np.array(llm.scores[llm.n_tokens - 1])
            top2 = np.sort(ref)[-2:]
            if top2[1] - top2[0] < NEAR_TIE:
                break
            want = int(ref.argmax())
            assert int(ours.argmax()) == want, f"{name}: step {compared} differs"
            compared += 1
            llm.eval([want])
            ours = engine.forward(200 + i, [want])[-1]
        engine.release(200 + i)
        total += compared
        print(f"{name} prompt {i}: {compared} greedy tokens agree before a near-tie/end")
    assert total >= MIN_GREEDY_COMPARED


@pytest.fixture(scope="module")
def small_engine(synthetic_model):
    # F32 weights: the small-n and large-n matmul paths then agree to float rounding, so
    # chunking and caching are compared exactly rather than through int8 activation noise.
    return LLM(str(synthetic_model("llama", "F32")), threads=2, ctx=40, parallel=2).engine


def test_bad_token_ids(small_engine):
    vocab = small_engine.runner.config.vocab_size
    for bad in ([vocab], [-1], [1.5], []):
        with pytest.raises(EdgeInferError):
            small_engine.forward(0, bad)
    assert small_engine.scheduler.seq_len(0) == 0


def test_context_overflow_leaves_sequence_intact(small_engine):
    small_engine.forward(1, list(range(30)))
    with pytest.raises(EdgeInferError, match="context length 40"):
        small_engine.forward(1, list(range(11)))
    assert small_engine.scheduler.seq_len(1) == 30
    small_engine.forward(1, list(range(10)))  # exactly up to the limit still works
    assert small_engine.scheduler.seq_len(1) == 40
    small_engine.release(1)


def test_a_sequence_continued_in_passes_matches_one_pass(small_engine):
    e = small_engine
    a = list(range(5, 30))
    full = e.forward(2, a)
    e.release(2)
    parts = [e.forward(3, a[:20]), e.forward(3, a[20:21]), e.forward(3, a[21:])]
    e.release(3)
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-3, atol=1e-3)
    assert e.blocks.num_used_blocks == 0


def test_kv_f32_close_to_f16(synthetic_model):
    path = str(synthetic_model("qwen3", "F32"))
    tokens = list(range(3, 40))
    a = LLM(path, ctx=64, kv_dtype="f16").logits(tokens)
    b = LLM(path, ctx=64, kv_dtype="f32").logits(tokens)
    assert np.sum((a - b) ** 2) / np.sum(b**2) < 1e-4
    with pytest.raises(EdgeInferError, match="kv dtype"):
        LLM(path, kv_dtype="q4")
