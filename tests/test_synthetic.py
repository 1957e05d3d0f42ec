"""The synthetic fixture models: llama.cpp loads and evaluates every (arch, ftype), the logits are
not degenerate, quantization really happened, and edgeinfer's loader agrees on the shapes."""

from __future__ import annotations

import sys

import gguf
import llama_cpp
import numpy as np
import pytest
import synthetic

from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import read_gguf

# The type llama.cpp gives blk.0.ffn_up.weight for each ftype (mixes like Q4_K_M raise some
# other tensors to higher-bit types).
FFN_UP_TYPE = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q6_K": "Q6_K",
    "Q5_K_M": "Q5_K", "Q5_1": "Q5_1", "Q5_0": "Q5_0", "Q4_K_M": "Q4_K", "Q4_1": "Q4_1",
    "Q4_0": "Q4_0", "Q3_K_M": "Q3_K", "Q2_K": "Q2_K",
}  # fmt: skip
# Lower bound on the correlation of quantized with F32 logits: fewer bits, looser bound.
MIN_CORR = {
    "F16": 0.9999, "BF16": 0.999, "Q8_0": 0.999, "Q6_K": 0.99, "Q5_K_M": 0.98,
    "Q5_1": 0.98, "Q5_0": 0.98, "Q4_K_M": 0.94, "Q4_1": 0.94, "Q4_0": 0.94,
    "Q3_K_M": 0.9, "Q2_K": 0.7,
}  # fmt: skip
N_TOKENS = 48  # longer than gemma3's sliding window of 32


def token_ids(arch: str) -> list[int]:
    vocab = synthetic.build_vocab(arch)
    rng = np.random.default_rng(0)
    return [vocab.bos] + rng.integers(
        len(vocab.tokens) // 2, len(vocab.tokens), N_TOKENS - 1
    ).tolist()


def llama_logits(path, ids: list[int]) -> np.ndarray:
    """ids: [n] -> llama.cpp's float32[n, vocab] logits."""
    llm = llama_cpp.Llama(
        str(path), n_ctx=64, n_batch=64, logits_all=True, n_threads=2, verbose=False
    )
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def f32_logits(synthetic_model):
    return {a: llama_logits(synthetic_model(a, "F32"), token_ids(a)) for a in synthetic.ARCHS}


@pytest.mark.parametrize("arch", synthetic.ARCHS)
def test_f32_logits_are_informative(f32_logits, arch):
    logits = f32_logits[arch]
    assert np.isfinite(logits).all()
    spread = logits.std(axis=1)
    assert (spread > 0.3).all() and (spread < 30).all()
    assert len(set(logits.argmax(axis=1).tolist())) > N_TOKENS // 4  # not one stuck token


@pytest.mark.parametrize("arch", synthetic.ARCHS)
@pytest.mark.parametrize("ftype", [f for f in synthetic.FTYPES if f != "F32"])
def test_quantized_model(synthetic_model, f32_logits, arch, ftype):
    path = synthetic_model(arch, ftype)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_up.weight"] == FFN_UP_TYPE[ftype]
    logits = llama_logits(path, token_ids(arch))
    corr = np.corrcoef(logits.ravel(), f32_logits[arch].ravel())[0, 1]
    assert corr > MIN_CORR[ftype], f"{arch} {ftype}: correlation {corr:.4f}"


@pytest.mark.parametrize("arch", synthetic.ARCHS)
def test_edgeinfer_config_matches_generator(synthetic_model, arch):
    s = synthetic.SHAPES[arch]
    with read_gguf(synthetic_model(arch, "Q4_K_M")) as g:
        cfg = ModelConfig.from_gguf(g)
    assert (cfg.arch, cfg.n_layers, cfg.n_embd, cfg.n_ff) == (arch, s.n_layers, s.n_embd, s.n_ff)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (s.n_heads, s.n_kv_heads, s.head_dim)
    assert cfg.vocab_size == len(synthetic.build_vocab(arch).tokens)
    assert cfg.tied_output == s.tied_output
    assert cfg.sliding_window == s.sliding_window


def test_spm_vocab_tokenizes_words(synthetic_model):
    """llama.cpp reaches whole-word pieces through the vocab's merges."""
    vocab = synthetic.build_vocab("llama")
    llm = llama_cpp.Llama(str(synthetic_model("llama", "F32")), vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(b"Hello world, the fox")
    finally:
        llm.close()
    pieces = [vocab.tokens[i] for i in ids]
    sp = synthetic.SPACE
    assert pieces == ["<s>", f"{sp}Hello", f"{sp}world", ",", f"{sp}the", f"{sp}fox"]


def test_cache_is_reused(synthetic_model):
    a = synthetic_model("qwen2", "Q4_0")
    mtime = a.stat().st_mtime_ns
    assert synthetic_model("qwen2", "Q4_0") == a and a.stat().st_mtime_ns == mtime
    assert a.parent.name == synthetic.generator_key(quantized=True)


def test_f32_models_are_written_without_llama_cpp(tmp_path, monkeypatch):
    def version(name):
        if name == "llama-cpp-python":
            raise AssertionError("the F32 writer asked for llama-cpp-python")
        return real_version(name)

    real_version = synthetic.version
    monkeypatch.setattr(synthetic, "version", version)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # importing it now fails
    synthetic.generator_key.cache_clear()
    try:
        path = synthetic.model_path("qwen3", "F32", cache_root=tmp_path)
        with read_gguf(path) as g:
            assert ModelConfig.from_gguf(g).arch == "qwen3"
    finally:
        synthetic.generator_key.cache_clear()
