"""`edgeinfer eval`: perplexity over windows (llama-perplexity's rules, llama.cpp as the oracle),
KL statistics against a reference model or saved log-probabilities, per-tensor weight error,
and the per-type perplexity ladder of a synthetic model family."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_checks import edgeinfer, one_error_line
from llama_oracle import kl, log_softmax, oracle
from reference_forward import ReferenceModel

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError
from edgeinfer.eval import logits_file, stats, weights, windows
from edgeinfer.llm import LLM

TEXT = Path(__file__).parent / "data" / "eval" / "shakespeare.txt"
PPL_TOLERANCE = 0.005  # the target: within 0.5 % of llama.cpp on the same windows


# -- statistics ---------------------------------------------------------------------------


def test_score_and_kl_match_float64_numpy():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((7, 301)) * 4).astype(np.float32)
    base = (logits + rng.standard_normal(logits.shape).astype(np.float32) * 0.3).astype(np.float32)
    targets = rng.integers(0, 301, 7)
    s = stats.score(logits, targets)
    lp = log_softmax(logits)
    np.testing.assert_allclose(s.nll, -lp[np.arange(7), targets], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(s.top, logits.argmax(1))
    b = stats.score(base, targets)
    np.testing.assert_allclose(
        stats.kl_rows(base, b.lse, logits, s.lse), kl(base, logits), rtol=1e-4, atol=1e-8
    )


def test_totals_follow_llama_cpp_formulas_and_layout():
    rng = np.random.default_rng(1)
    nll = rng.exponential(2.0, 500)
    nll_b = nll * 0.9 + rng.exponential(0.1, 500)
    t = stats.Totals()
    s, b = (
        stats.Scores(nll, np.zeros(500, np.int64), nll),
        stats.Scores(nll_b, np.zeros(500, np.int64), nll_b),
    )
    t.add(s, b, np.abs(nll - nll_b) * 0.01)
    out = t.summary()
    mean = nll.mean()
    err = math.sqrt(((nll**2).mean() - mean**2) / 499)
    assert out["perplexity"] == pytest.approx(math.exp(mean), rel=1e-12)
    assert out["perplexity_stderr"] == pytest.approx(math.exp(mean) * err, rel=1e-9)
    assert out["top1_agreement"] == 1.0
    assert out["kl"]["median"] == pytest.approx(np.median(np.abs(nll - nll_b) * 0.01))
    text = stats.report(out).splitlines()
    assert text[0].startswith("Final estimate: PPL = ")
    for line in (
        "====== Perplexity statistics ======",
        "====== KL divergence statistics ======",
        "====== Token probability statistics ======",
    ):
        assert line in text
    labels = [line.split(":")[0] for line in text if "KLD" in line.split(":")[0]]
    assert labels == ["Mean    KLD", "Maximum KLD", "99.9%   KLD", "99.0%   KLD", "95.0%   KLD",
                      "90.0%   KLD", "Median  KLD", "10.0%   KLD", " 5.0%   KLD", " 1.0%   KLD",
                      " 0.1%   KLD", "Minimum KLD"]  # fmt: skip
    assert any(line.startswith("Same top p: 100.000 ±") for line in text)


def test_saved_log_probs_round_trip_within_the_format_resolution():
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((5, 1001)) * 5).astype(np.float32)
    rows = logits_file.encode(logits)
    assert rows.shape == (5, logits_file.row_width(1001)) and rows.dtype == np.uint16
    lp = logits_file.decode(rows, 1001)
    exact = log_softmax(logits)
    top = exact.max(1, keepdims=True)
    resolved = exact > top - 16
    assert np.abs(lp - exact)[resolved].max() < 2 * 16 / 65535 + 1e-5
    assert np.all(lp[~resolved] <= (top - 16 + 1e-4).repeat(1001, 1)[~resolved])


def test_kl_against_saved_log_probs_leaves_out_the_unresolved_tail():
    """A big vocabulary's tail (here 20k tokens 30+ nats down) is stored at one floor; counting
    it would add ~vocab x e^-16 of phantom probability to KL."""
    rng = np.random.default_rng(4)
    base = np.full((4, 20000), -30.0, np.float32) + rng.standard_normal((4, 20000)).astype(
        np.float32
    )
    base[:, :50] = rng.standard_normal((4, 50)) * 2
    model = (base + rng.standard_normal(base.shape) * 0.05).astype(np.float32)
    m = stats.score(model, np.zeros(4, np.int64))
    b = stats.score(base, np.zeros(4, np.int64))
    exact = stats.kl_rows(base, b.lse, model, m.lse)
    saved = logits_file.decode(logits_file.encode(base), 20000)
    via_file = stats.kl_rows(saved, np.zeros(4), model, m.lse, -logits_file.RANGE)
    np.testing.assert_allclose(via_file, exact, atol=2e-4)


# -- perplexity against llama.cpp -----------------------------------------------------------


def perplexity_of(logits_fn, tokens: np.ndarray, n_ctx: int, n_windows: int, bos) -> float:
    """llama-perplexity's computation from another engine's logits of the same windows."""
    first, nll = n_ctx // 2, []
    for i in range(n_windows):
        w = tokens[i * n_ctx : (i + 1) * n_ctx].tolist()
        if bos is not None:
            w[0] = bos
        lp = log_softmax(np.asarray(logits_fn(w))[first : n_ctx - 1])
        nll.append(-lp[np.arange(n_ctx - 1 - first), w[first + 1 :]])
    return math.exp(np.concatenate(nll).mean())


def llama_cpp_perplexity(path, tokens: np.ndarray, n_ctx: int, n_windows: int) -> float:
    o = oracle(path, n_ctx)
    adds_bos = o.tokenize(b"a", add_bos=True)[0] == o.token_bos()

    def logits(w):
        o.reset()
        o.eval(w)
        return o.scores[: len(w)]

    return perplexity_of(logits, tokens, n_ctx, n_windows, o.token_bos() if adds_bos else None)


def sample_text(llm: LLM, n_ctx: int, n: int) -> np.ndarray:
    """n windows of tokens sampled from llm itself, each from BOS: text a random-weight model
    finds plausible (on real text its perplexity runs to millions, amplifying every rounding)."""
    bos = llm.tokenizer.bos_id
    params = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s,
                             max_tokens=n_ctx - 1, ignore_eos=True) for s in range(n)]  # fmt: skip
    return np.concatenate([[bos, *c.token_ids] for c in llm.generate([[bos]] * n, params)])


@pytest.mark.parametrize("arch, ftype", [("llama", "Q4_K_M"), ("gemma3", "Q6_K")])
def test_perplexity_matches_llama_cpp_on_synthetic(synthetic_model, arch, ftype):
    path = synthetic_model(arch, ftype)
    llm = LLM(str(path), threads=2, ctx=128, parallel=3)
    tokens = sample_text(llm, 128, 3)
    r = windows.evaluate(llm, tokens, 128).summary
    assert r["windows"] == 3 and r["tokens"] == 3 * 63
    want = llama_cpp_perplexity(path, tokens, 128, 3)
    print(f"{arch} {ftype}: edgeinfer {r['perplexity']:.4f}, llama.cpp {want:.4f}")
    assert abs(r["perplexity"] / want - 1) < PPL_TOLERANCE


def test_real_model_perplexity_cli_against_llama_cpp_and_exact_math(real_model):
    """The CLI's perplexity of SmolLM2 against llama.cpp's on the same windows, and both
    against exact math (the float64 reference pass). The 0.5 % target holds wherever
    llama.cpp's own distance from exact math (int8 activations: 0.7 % on these two windows)
    leaves room for it; edgeinfer's float activations (--precision exact) stay within 0.05 % of
    exact."""
    path = real_model("smollm2-135m-instruct")
    r = edgeinfer("eval", str(path), "--text", str(TEXT), "--ctx", "256", "--chunks", "2",
                  "--json", "-t", "2", "--precision", "exact")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["windows"] == 2 and out["tokens"] == 2 * 127 and out["ctx"] == 256
    assert out["perplexity_stderr"] > 0
    assert r.stderr.count("[") >= 2  # a progress line per window (stderr is not a terminal)
    o = oracle(path, 256)
    tokens = np.array(o.tokenize(TEXT.read_bytes()[:20000], add_bos=True), np.int64)
    llama = llama_cpp_perplexity(path, tokens, 256, 2)
    exact = perplexity_of(ReferenceModel(path).logits, tokens, 256, 2, None)  # SmolLM2: no BOS
    ours = out["perplexity"]
    print(f"SmolLM2 ctx 256 x 2: edgeinfer {ours:.4f}, llama.cpp {llama:.4f}, exact {exact:.4f}")
    assert abs(ours / exact - 1) < 5e-4
    assert abs(ours / llama - 1) < max(PPL_TOLERANCE, abs(llama / exact - 1) + 5e-4)


# -- the window rule, references, saved logits ----------------------------------------------


@pytest.fixture(scope="module")
def small(synthetic_model):
    f32 = LLM(str(synthetic_model("llama", "F32")), threads=2, ctx=64, parallel=1)
    q4 = LLM(str(synthetic_model("llama", "Q4_0")), threads=2, ctx=64, parallel=1)
    tokens = np.array(f32.tokenizer.encode(TEXT.read_text()[:3000]), np.int64)
    return f32, q4, tokens


def test_windows_score_the_second_half_of_each_window_with_bos_first(small):
    f32, _, tokens = small
    n_ctx, n = 64, len(tokens) // 64
    r = windows.evaluate(f32, tokens, n_ctx).summary
    bos = f32.tokenizer.bos_id
    nll = []
    for i in range(n):  # the rule, spelled out on llm.logits
        w = tokens[i * n_ctx : (i + 1) * n_ctx].tolist()
        w[0] = bos
        lp = log_softmax(f32.logits(w))
        nll += [-lp[j, w[j + 1]] for j in range(32, 63)]
    assert r["windows"] == n and r["tokens"] == n * 31 == len(nll)
    assert r["perplexity"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-6)
    assert windows.evaluate(f32, tokens, n_ctx, chunks=2).summary["tokens"] == 62
    with pytest.raises(EdgeInferError, match="needs at least 64"):
        windows.evaluate(f32, tokens[:63], n_ctx)
    assert f32.engine.blocks.num_used_blocks == 0  # every window released


def test_reference_statistics(small):
    f32, q4, tokens = small
    same = windows.evaluate(f32, tokens, 64, chunks=3, reference=f32).summary
    assert same["kl"]["mean"] == pytest.approx(0, abs=1e-9)
    assert same["top1_agreement"] == 1.0 and same["ppl_ratio"] == pytest.approx(1.0)
    r = windows.evaluate(q4, tokens, 64, chunks=3, reference=f32).summary
    # KL(F32 || Q4_0) by hand on the same scored rows
    want = []
    for i in range(3):
        w = windows.window(tokens, i, 64, f32.tokenizer.bos_id).tolist()
        want.append(kl(f32.logits(w)[32:63], q4.logits(w)[32:63]))
    want = np.concatenate(want)
    assert r["kl"]["mean"] == pytest.approx(want.mean(), rel=1e-5)
    assert r["kl"]["max"] == pytest.approx(want.max(), rel=1e-5)
    assert r["kl"]["mean"] > 1e-3 and 0.5 < r["top1_agreement"] < 1.0
    assert r["perplexity_reference"] == pytest.approx(same["perplexity"], rel=1e-9)


def test_saved_logits_reference_matches_the_model_reference(small, tmp_path):
    f32, q4, tokens = small
    saved = tmp_path / "f32.logits"
    windows.evaluate(f32, tokens, 64, chunks=3, save_logits=str(saved))
    vocab = f32.config.vocab_size
    head = np.fromfile(saved, np.uint8, 20)
    assert head[:8].tobytes() == b"_logits_"
    assert np.frombuffer(head[8:], "<i4").tolist() == [64, vocab, 3]
    assert saved.stat().st_size == 20 + 4 * 3 * 64 + 2 * 3 * 31 * logits_file.row_width(vocab)
    direct = windows.evaluate(q4, tokens, 64, chunks=3, reference=f32).summary
    reader = logits_file.LogitsReader(saved)
    via_file = windows.evaluate(q4, tokens, 64, reference=reader).summary
    assert via_file["windows"] == 3
    assert via_file["kl"]["mean"] == pytest.approx(direct["kl"]["mean"], rel=0.01)
    assert via_file["perplexity_reference"] == pytest.approx(
        direct["perplexity_reference"], rel=1e-3
    )
    assert via_file["top1_agreement"] == direct["top1_agreement"]
    with pytest.raises(EdgeInferError, match="not this text"):
        windows.evaluate(q4, tokens[1:], 64, reference=reader)


def test_eval_cli_reference_report_and_user_errors(synthetic_model, tmp_path):
    q4, f32 = str(synthetic_model("llama", "Q4_0")), str(synthetic_model("llama", "F32"))
    text = tmp_path / "t.txt"
    text.write_text(TEXT.read_text()[:2000])
    r = edgeinfer("eval", q4, "--text", str(text), "--ctx", "64", "--reference", f32,
                  "--chunks", "4")  # fmt: skip
    assert r.returncode == 0, r.stderr
    for line in ("Final estimate: PPL = ", "Mean PPL(Q)  ", "Mean    KLD: ", "99.0%   KLD: ",
                 "Same top p: ", "RMS Δp    : "):  # fmt: skip
        assert line in r.stdout, r.stdout
    saved = tmp_path / "f32.logits"
    r = edgeinfer("eval", f32, "--text", str(text), "--ctx", "64", "--save-logits", str(saved),
                  "--chunks", "4")  # fmt: skip
    assert r.returncode == 0, r.stderr
    via_model = edgeinfer("eval", q4, "--text", str(text), "--ctx", "64", "--reference", f32,
                          "--json", "--chunks", "4")  # fmt: skip
    via_file = edgeinfer("eval", q4, "--reference", str(saved), "--json")  # tokens from the file
    assert via_file.returncode == 0, via_file.stderr
    a, b = json.loads(via_model.stdout), json.loads(via_file.stdout)
    assert b["ctx"] == 64 and b["windows"] == a["windows"] == 4
    assert b["kl"]["mean"] == pytest.approx(a["kl"]["mean"], rel=0.01)
    one_error_line(edgeinfer("eval", q4, "--reference", str(saved), "--ctx", "32"), "--ctx 64")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8")
    one_error_line(edgeinfer("eval", q4, "--text", str(bad), "--ctx", "64"), "not UTF-8")
    one_error_line(edgeinfer("eval", q4, "--ctx", "64"), "--text")
    one_error_line(edgeinfer("eval", q4, "--text", str(tmp_path / "nope.txt")), "nope.txt")
    one_error_line(edgeinfer("eval", q4, "--text", str(text), "--ctx", "4096"), "4096")
    short = tmp_path / "short.txt"
    short.write_text("the quick brown fox")
    one_error_line(edgeinfer("eval", q4, "--text", str(short), "--ctx", "64"), "needs at least")
    other = str(synthetic_model("gemma3", "F32"))  # another vocabulary
    one_error_line(
        edgeinfer("eval", q4, "--text", str(text), "--ctx", "64", "--reference", other),
        "vocabulary",
    )
    one_error_line(edgeinfer("eval", q4, "--weights", q4, f32), "--weights")


# -- weights ---------------------------------------------------------------------------------


def test_weights_compare_per_tensor(synthetic_model):
    from edgeinfer import kernels

    q8, f32 = synthetic_model("llama", "Q8_0"), synthetic_model("llama", "F32")
    errors, a, b = weights.compare(q8, f32)
    assert len(errors) == len(b.tensors)
    assert [e.nmse for e in errors] == sorted((e.nmse for e in errors), reverse=True)
    e = next(e for e in errors if e.name == "blk.0.attn_q.weight")
    info_a, info_b = a.tensors[e.name], b.tensors[e.name]
    xa = kernels.dequantize(a.tensor_data(e.name), info_a.qtype, info_a.shape).astype(np.float64)
    xb = kernels.dequantize(b.tensor_data(e.name), info_b.qtype, info_b.shape).astype(np.float64)
    assert e.nmse == pytest.approx(((xa - xb) ** 2).sum() / (xb**2).sum(), rel=1e-9)
    assert e.max_error == pytest.approx(np.abs(xa - xb).max())
    assert e.type_a == "Q8_0" and e.type_b == "F32" and 1e-6 < e.nmse < 1e-3
    assert weights.bits_per_weight(b) == 32.0 and 8 < weights.bits_per_weight(a) < 9
    same, _, _ = weights.compare(f32, f32)
    assert all(x.nmse == 0 and x.max_error == 0 for x in same)
    with pytest.raises(EdgeInferError, match="not the same model"):
        weights.compare(q8, synthetic_model("qwen2", "F32"))


def test_weights_cli_table(synthetic_model):
    q4, f32 = str(synthetic_model("llama", "Q4_K_M")), str(synthetic_model("llama", "F32"))
    r = edgeinfer("eval", "--weights", q4, f32)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["tensor", "shape", "A", "B"]
    nmse = [float(line.split()[4]) for line in lines[1:22]]
    assert nmse == sorted(nmse, reverse=True)
    assert lines[-3].startswith("A ") and "bits per weight" in lines[-3]
    assert lines[-1].startswith("all weights: NMSE ")
    j = json.loads(edgeinfer("eval", "--weights", q4, f32, "--json").stdout)
    assert j["b"]["bits_per_weight"] == 32.0 and 4.5 < j["a"]["bits_per_weight"] < 5.5
    assert j["tensors"][0]["nmse"] >= j["tensors"][-1]["nmse"]


# -- the per-type ladder ---------------------------------------------------------------------

LADDER = ("F32", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")


def test_perplexity_ladder_of_a_synthetic_family(synthetic_model):
    """On text sampled from the F32 model itself, F32 is the best predictor there is, so each
    coarser type's perplexity must be higher: PPL(Q) ~ PPL(F32) * exp(KL). Adjacent steps may
    tie within noise (their ratio's standard error); the big steps may not."""
    n_ctx, n = 128, 6
    f32 = LLM(str(synthetic_model("llama", "F32")), threads=2, ctx=n_ctx, parallel=n)
    tokens = sample_text(f32, n_ctx, n)
    rows = {}
    for ftype in LADDER:
        llm = LLM(str(synthetic_model("llama", ftype)), threads=2, ctx=n_ctx, parallel=1)
        rows[ftype] = windows.evaluate(llm, tokens, n_ctx, reference=f32).summary
        print(f"{ftype:7} PPL {rows[ftype]['perplexity']:9.4f}  KL {rows[ftype]['kl']['mean']:.2e}")
    ppl = [rows[t]["perplexity"] for t in LADDER]
    for a, b in zip(LADDER[:-1], LADDER[1:], strict=True):
        ratio = rows[b]["perplexity"] / rows[a]["perplexity"]
        noise = max(rows[a]["ppl_ratio_stderr"], rows[b]["ppl_ratio_stderr"])
        assert ratio > 1 - 2 * noise, f"{b} below {a}: {ratio:.4f}"
    assert ppl[1] == pytest.approx(ppl[0], rel=1e-4)  # F16 ~ F32
    assert ppl[0] < ppl[2] < ppl[5] < ppl[7] < ppl[8]  # F32 < Q8_0 < Q4_K_M < Q3_K_M < Q2_K
    kls = [rows[t]["kl"]["mean"] for t in LADDER[1:]]
    assert kls == sorted(kls)
