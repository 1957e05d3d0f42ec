"""Accuracy judged against exact math: the float64 reference pass (tests/reference_forward.py)
from each file's own dequantized weights is the oracle, not another engine's rounding.

First the reference itself is checked against two independent implementations on synthetic
F32 files of every architecture (llama.cpp and edgeinfer agree with it to float32 rounding).
Then, on both real models (their quantized files, f16 KV on both engines, the parity prompts:
>= 256 positions), KL(reference || edgeinfer) must not exceed KL(reference || llama.cpp):
edgeinfer's exact path (precision="exact") keeps activations in float where llama.cpp rounds
them to int8 blocks.
(test_models_parity keeps the direct comparison with llama.cpp, bounded by its measured floor.)
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import synthetic
from llama_oracle import PROMPTS, kl, oracle, oracle_logits
from reference_forward import ReferenceModel

from edgeinfer.llm import LLM

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
N_SYNTH = 48  # > the synthetic gemma3's sliding window (32)
EDGEINFER_KL_MAX = 1e-5  # measured ~3e-7 on both real models; llama.cpp's is ~3e-3 - 5e-3


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    return float(((a - ref) ** 2).sum() / (ref**2).sum())


@functools.cache
def f32_reference(arch: str) -> tuple[Path, list[int], np.ndarray]:
    """The synthetic F32 model of arch, tokens, and the float64 reference's logits on them."""
    path = synthetic.model_path(arch, "F32")
    tokens = np.random.default_rng(3).integers(0, 300, N_SYNTH).tolist()
    return path, tokens, ReferenceModel(path).logits(tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_agrees_with_edgeinfer_on_f32_weights(arch):
    # needs no llama.cpp: make test-arm runs it
    path, tokens, ref = f32_reference(arch)
    ours = LLM(str(path), threads=2, ctx=64).logits(tokens).astype(np.float64)
    print(f"{arch}: NMSE edgeinfer {nmse(ours, ref):.1e}")
    assert nmse(ours, ref) < 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_agrees_with_llama_cpp_on_f32_weights(arch):
    path, tokens, ref = f32_reference(arch)
    theirs = oracle_logits(oracle(path, 64), tokens)
    print(f"{arch}: NMSE llama.cpp {nmse(theirs, ref):.1e}")
    assert nmse(theirs, ref) < 1e-4  # f16 K/V in llama.cpp's cache


def test_reference_uses_the_files_own_weights(synthetic_model):
    """From a quantized file the reference computes that file's output, so an engine running
    the same file matches it as closely as on F32 weights (float activations)."""
    path = synthetic_model("qwen3", "Q4_K_M")
    tokens = list(range(3, 40))
    ref = ReferenceModel(path).logits(tokens)
    exact = LLM(str(path), threads=2, ctx=64, precision="exact")
    assert nmse(exact.logits(tokens).astype(np.float64), ref) < 1e-6
    f32_ref = ReferenceModel(synthetic_model("qwen3", "F32")).logits(tokens)
    assert nmse(ref, f32_ref) > 1e-4  # and it is not the F32 model's output


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_model_closer_to_exact_math_than_llama_cpp(real_model, name):
    path = real_model(name)
    ref, llm = ReferenceModel(path), oracle(path, 512)
    engine = LLM(str(path), threads=2, ctx=512, precision="exact")
    ours, theirs, top_ours, top_theirs = [], [], [], []
    for text in PROMPTS:
        tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
        exact = ref.logits(tokens)
        mine, other = engine.logits(tokens), oracle_logits(llm, tokens)
        ours.append(kl(exact, mine))
        theirs.append(kl(exact, other))
        top_ours.append(exact.argmax(-1) == mine.argmax(-1))
        top_theirs.append(exact.argmax(-1) == other.argmax(-1))
    ours, theirs = np.concatenate(ours), np.concatenate(theirs)
    t_ours, t_theirs = np.concatenate(top_ours).mean(), np.concatenate(top_theirs).mean()
    assert ours.size >= 256
    print(
        f"{name}: {ours.size} positions, KL(exact || edgeinfer) {ours.mean():.2e} "
        f"(top-1 {t_ours:.2%}), KL(exact || llama.cpp) {theirs.mean():.2e} (top-1 {t_theirs:.2%})"
    )
    assert ours.mean() <= theirs.mean()
    assert ours.mean() <= EDGEINFER_KL_MAX
    assert t_ours >= t_theirs
