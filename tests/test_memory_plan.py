"""The memory plan's arithmetic, checked against sums computed here from the generator's shapes,
tensor sizes read with the PyPI `gguf` reader (not edgeinfer's) and Gemma 3 270M's known shape."""

from __future__ import annotations

import gguf
import pytest
import synthetic

from edgeinfer.config import FFN_PIECE_COLS
from edgeinfer.engine import memory_plan
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import read_gguf


def load(path):
    g = read_gguf(path)
    return ModelConfig.from_gguf(g), g


def blocks_of(tokens: int) -> int:
    return (tokens + 15) // 16


def window_blocks(window: int, chunk: int = 512) -> int:
    """Most 16-token blocks a sliding-window layer's sequence holds in one step, found by trying
    every first position p: the step reads from p's window start and writes `chunk` tokens."""
    return max((p + chunk - 1) // 16 - max(0, p - window + 1) // 16 + 1 for p in range(4 * window))


@pytest.mark.parametrize("arch", synthetic.ARCHS)
@pytest.mark.parametrize(
    ("ctx", "parallel", "kv_dtype"), [(1, 1, "f16"), (100, 3, "f32"), (256, 2, "f16")]
)
def test_kv_bytes(synthetic_model, arch, ctx, parallel, kv_dtype):
    s = synthetic.SHAPES[arch]
    cfg, g = load(synthetic_model(arch, "Q4_0"))
    p = memory_plan.plan(cfg, g, ctx=ctx, parallel=parallel, kv_dtype=kv_dtype)
    item = {"f16": 2, "f32": 4}[kv_dtype]
    per_layer_token = s.n_kv_heads * 2 * s.head_dim * item  # K and V
    assert p.kv_bytes_per_token == s.n_layers * per_layer_token
    tokens = blocks_of(ctx) * 16
    assert p.kv_bytes_every_token == s.n_layers * per_layer_token * tokens * parallel
    if s.sliding_window:
        # llama.cpp's gemma3 rule: layer i is global when i % 6 == 5
        sliding = sum(i % 6 != 5 for i in range(s.n_layers))
        window_tokens = min(tokens, window_blocks(s.sliding_window) * 16)
        capped = (s.n_layers - sliding) * tokens + sliding * window_tokens
        assert p.sliding_layers == sliding
        assert p.kv_bytes == capped * per_layer_token * parallel
    else:
        assert p.sliding_layers == 0 and p.kv_bytes == p.kv_bytes_every_token


def test_weights_and_activations(synthetic_model):
    path = synthetic_model("llama", "Q4_K_M")
    cfg, g = load(path)
    p = memory_plan.plan(cfg, g, ctx=200, parallel=2)
    assert p.weights_bytes == sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    s, vocab = synthetic.SHAPES["llama"], len(synthetic.build_vocab("llama").tokens)
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    # layer buffers (an FFN of one piece: [gate | up] and act(gate) * up, 3 x n_ff), and the
    # int8 GEMM's copy of its largest input
    assert s.n_ff <= FFN_PIECE_COLS
    per_token = 2 * s.n_embd + q + 2 * kv + q + 3 * s.n_ff + max(s.n_embd, q, s.n_ff)
    assert p.activation_bytes == 200 * per_token * 4 + 2 * vocab * 4
    assert p.total_bytes == p.weights_bytes + p.kv_bytes + p.activation_bytes
    assert p.ctx == 200 and p.repacked_bytes is None


def test_fits_and_largest_context(synthetic_model):
    cfg, g = load(synthetic_model("qwen3", "Q8_0"))
    need_128 = memory_plan.plan(cfg, g, ctx=128, parallel=2, available_bytes=0).total_bytes
    p = memory_plan.plan(cfg, g, ctx=200, parallel=2, available_bytes=need_128)
    assert not p.fits and (p.max_ctx, p.max_ctx_limit) == (128, "memory")
    p = memory_plan.plan(cfg, g, ctx=128, parallel=2, available_bytes=need_128)
    assert p.fits and p.max_ctx == 128
    assert memory_plan.plan(cfg, g, ctx=1, parallel=2, available_bytes=need_128 - 1).max_ctx == 112
    p = memory_plan.plan(cfg, g, parallel=2, available_bytes=10**12)
    assert p.fits and (p.max_ctx, p.max_ctx_limit) == (cfg.ctx_len, "model")
    p = memory_plan.plan(cfg, g, available_bytes=1000)
    assert not p.fits and p.max_ctx == 0


def test_repacked_bytes_count(synthetic_model):
    cfg, g = load(synthetic_model("llama", "Q4_0"))
    base = memory_plan.plan(cfg, g, ctx=64)
    more = memory_plan.plan(cfg, g, ctx=64, repacked_bytes=12345)
    assert more.total_bytes == base.total_bytes + 12345


def test_default_context_and_dtype_check(synthetic_model):
    cfg, g = load(synthetic_model("llama", "Q4_0"))
    assert memory_plan.plan(cfg, g).ctx == min(cfg.ctx_len, memory_plan.DEFAULT_CTX)
    with pytest.raises(ValueError):
        memory_plan.plan(cfg, g, kv_dtype="q8")


def test_real_gemma_kv(real_model):
    # Gemma 3 270M's published shape: 18 layers, 1 KV head, K and V heads of 256, a 512-token
    # window on all layers but every 6th. (The PyPI reader needs ~40 s for its 262k-token vocab.)
    layers, kv_heads, dims, window = 18, 1, 256 + 256, 512
    cfg, g = load(real_model("gemma3-270m"))
    p = memory_plan.plan(cfg, g, ctx=4096, parallel=2)
    assert p.kv_bytes_per_token == layers * kv_heads * dims * 2
    assert p.kv_bytes_every_token == 4096 * 2 * p.kv_bytes_per_token
    assert (p.sliding_layers, p.sliding_window) == (15, window)
    capped = (3 * 4096 + 15 * window_blocks(window) * 16) * kv_heads * dims * 2 * 2
    assert p.kv_bytes == capped
    # issue 33's target: at 32k the window-capped cache is at most 30 % of every token's
    p = memory_plan.plan(cfg, g, ctx=32768, parallel=1)
    assert p.kv_bytes <= 0.30 * p.kv_bytes_every_token
