"""llama.cpp (llama-cpp-python) as the logits oracle: shared by test_models_parity and
bench/parity.py (which puts this folder on its path)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# varied text, >= 256 positions in all
PROMPTS = json.loads((Path(__file__).parent / "data" / "parity_prompts.json").read_text())
F32 = 0  # GGML_TYPE_F32, for llama.cpp's type_k / type_v (a float32 KV cache)


def oracle(path, n_ctx: int, threads: int = 2, **options):
    """A llama.cpp context on the GGUF file at path that keeps every position's logits; options:
    more llama_cpp.Llama arguments (type_k, n_batch, ...)."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, logits_all=True, n_threads=threads, verbose=False,
        **options,
    )  # fmt: skip


def oracle_logits(llm, tokens) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl(ref: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(ours)) per row."""
    lp, lq = log_softmax(ref), log_softmax(ours)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)
