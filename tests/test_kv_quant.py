"""Quantized KV caches (--kv-dtype q8_0 / q4_0, llama.cpp's -ctk/-ctv): each token's K and V
head vectors are stored as ggml's blocks (checked bit for bit against gguf's quantizer) of the
vector rotated by a Hadamard transform (as llama.cpp's), attention reads back exactly those
values (against float64 attention over gguf's dequantized blocks, turned back), a token's bits
still do not depend on how its sequence was split, and a model's logits with a q8_0 cache are
at least as close to exact math (the float64 reference) as llama.cpp's with its own q8_0
cache. The memory plan counts the bytes the cache allocates."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from llama_oracle import kl, oracle, oracle_logits
from reference_forward import ReferenceModel
from test_attention import ref_attention as dense_attention
from test_cli_info import assert_clean_error, cli

from edgeinfer.config import ConfigError
from edgeinfer.engine import memory_plan
from edgeinfer.engine.kv_cache import BLOCK_SIZE, KVCache
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.kernels.attention import SPLIT_BLOCKS, self_attention
from edgeinfer.llm import LLM

QTYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0}
GGML_TYPE_IDS = {"f16": 1, "q8_0": 8, "q4_0": 2}  # llama.cpp's type_k / type_v
NONE = np.zeros(0, np.float32)


def ggml_blocks(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """x: float32[dim] -> (float16 bits of each group's scale, its code bytes) by gguf's
    quantizer (q8_0: 32 int8 codes a group; q4_0: 16 bytes of two 4-bit codes)."""
    raw = quantize(x[None], QTYPES[dtype]).reshape(x.size // 32, -1)
    return raw[:, :2].copy().view(np.uint16)[:, 0], raw[:, 2:]


def hadamard(n: int) -> np.ndarray:
    """Sylvester's H_n (entries +-1), float64: H_n / sqrt(n) is orthonormal, its own inverse."""
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h


def sums(x: np.ndarray, n: int) -> np.ndarray:
    """x: [..., dim] -> each run of n values along the last axis times H_n, in float64."""
    runs = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, n)
    return (runs @ hadamard(n)).reshape(x.shape)


def turn(x: np.ndarray, n: int) -> np.ndarray:
    """x rotated by the orthonormal H_n / sqrt(n) on runs of n, in float64."""
    return sums(x, n) / np.sqrt(n)


def runs(dk: int, dv: int) -> tuple[int, int]:
    """A quantized cache's Hadamard runs: keys within each group of 32, values over 64 where
    dv is a multiple of 64 (else 32)."""
    return 32, 64 if dv % 64 == 0 else 32


def round_trip(x: np.ndarray, dtype: str) -> np.ndarray:
    """x: float32[..., dim] as a quantized cache holds it (gguf's quantize then dequantize)."""
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float64)
    q = QTYPES[dtype]
    return dequantize(quantize(x, q), q).astype(np.float64)


class Cache:
    """An engine's KV pools for one layer and a block table per sequence (shuffled blocks)."""

    def __init__(self, lengths, nkv, dk, dv, dtype, seed=0):
        rng = np.random.default_rng(seed)
        per_seq = [-(-n // BLOCK_SIZE) for n in lengths]
        self.kv = KVCache(1, nkv, dk, dv, sum(per_seq) + 2, dtype=dtype)
        self.dk = dk
        perm = rng.permutation(self.kv.num_blocks)
        self.tables = np.zeros((len(lengths), max(per_seq)), np.int32)
        used = 0
        for s, nb in enumerate(per_seq):
            self.tables[s, :nb] = perm[used : used + nb]
            used += nb

    def attend(self, qkv, spans, nh, window=0, inv_freq=None):
        """spans: [(seq, start, stop)] -> outputs of those tokens, one call (a step's batch)."""
        rows = np.concatenate([np.full(b - a, s, np.int32) for s, a, b in spans])
        pos = np.concatenate([np.arange(a, b, dtype=np.int32) for s, a, b in spans])
        slots = self.tables[rows, pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
        slots += pos % BLOCK_SIZE
        dk = self.dk
        if inv_freq is None:  # no rotation (angle 0): keys are stored as given
            inv_freq = np.zeros(dk // 2)
        return self_attention(
            qkv.copy(), NONE, NONE, 1e-6, inv_freq, True, dk**-0.5, window, self.kv.k[0],
            self.kv.v[0], self.tables, rows, pos, slots, nh,
        ), slots  # fmt: skip


def head_rows(rng, n, nh, nkv, dk, dv):
    """qkv rows whose 32-value groups have very different magnitudes, one group all zeros and
    one with a tie for the largest magnitude (+m and -m: q4_0 takes the first)."""
    qkv = rng.standard_normal((n, (nh + nkv) * dk + nkv * dv)).astype(np.float32)
    qkv *= np.repeat(np.exp2(rng.integers(-6, 6, (n, qkv.shape[1] // 32))), 32, axis=1)
    k0 = nh * dk
    qkv[0, k0 : k0 + 32] = 0
    qkv[1, k0 + 32 : k0 + 64] = np.linspace(-1, 1, 32, dtype=np.float32)  # -1 first, then +1
    return qkv


def dyadic_rows(rng, n, width):
    """Rows of multiples of 1/256 below 8 in magnitude, groups of very different sizes, one
    group all zeros and one (-1 at its second place) that a run of 32 rotates to a tie for the
    largest magnitude, -m first (q4_0 takes the first). The butterflies' sums of at most 64
    such values are exact in float32, so the rotated vector is those sums times
    float32(1/sqrt(n)), one rounding, and has one right answer to quantize."""
    x = rng.integers(-63, 64, (n, width)) / 8
    x *= np.repeat(2.0 ** -rng.integers(0, 6, (n, width // 32)), 32, axis=1)
    x[0, :32] = 0
    x[1, 32:64] = 0
    x[1, 33] = -1
    return x.astype(np.float32)


def stored(x: np.ndarray, n: int) -> np.ndarray:
    """dyadic_rows' x as the cache rotates it before it quantizes (see dyadic_rows)."""
    return sums(x, n).astype(np.float32) * np.float32(1 / np.sqrt(n))


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dk, dv", [(96, 32), (256, 64)])
def test_written_groups_are_ggml_blocks_bit_for_bit(dtype, dk, dv):
    # keys turned within their groups of 32; values too (32) or over runs of 64
    nh, nkv = 4, 2
    k_run, v_run = runs(dk, dv)
    rng = np.random.default_rng(1)
    cache = Cache([21, 5], nkv, dk, dv, dtype)
    qkv = np.concatenate(
        [
            dyadic_rows(rng, 26, nh * dk),
            dyadic_rows(rng, 26, nkv * dk),
            dyadic_rows(rng, 26, nkv * dv),
        ],
        axis=1,
    )
    _, slots = cache.attend(qkv, [(0, 0, 21), (1, 0, 5)], nh)
    (kq, ks), (vq, vs) = cache.kv.k[0], cache.kv.v[0]
    for t, slot in enumerate(slots):
        blk, off = divmod(int(slot), BLOCK_SIZE)
        for h in range(nkv):
            k = stored(qkv[t, (nh + h) * dk : (nh + h + 1) * dk], k_run)
            v = stored(qkv[t, (nh + nkv) * dk + h * dv :][:dv], v_run)
            d, codes = ggml_blocks(k, dtype)
            np.testing.assert_array_equal(ks[blk, h, :, off], d)
            np.testing.assert_array_equal(kq[blk, h, :, off].view(np.uint8), codes.ravel())
            d, codes = ggml_blocks(v, dtype)
            np.testing.assert_array_equal(vs[blk, h, off], d)
            np.testing.assert_array_equal(vq[blk, h, off].view(np.uint8), codes.ravel())


def held(x: np.ndarray, run: int, dtype: str) -> np.ndarray:
    """Head vectors x: [rows, dim] as a quantized cache holds them, in float64: rotated over
    runs of `run`, gguf's quantize then dequantize, turned back."""
    return turn(round_trip(turn(x, run).astype(np.float32), dtype), run)


def ref_attention(qkv, nh, nkv, dk, dv, dtype, window):
    """One sequence's whole history, RoPE at angle 0 (keys stored as given), over the values
    that the quantized cache holds (held): qkv [L, width] -> [L, nh * dv]."""
    L, k0, v0 = qkv.shape[0], nh * dk, (nh + nkv) * dk
    k_run, v_run = runs(dk, dv)
    held_qkv = qkv.astype(np.float64)
    held_qkv[:, k0:v0] = held(qkv[:, k0:v0].reshape(L * nkv, dk), k_run, dtype).reshape(L, -1)
    held_qkv[:, v0:] = held(
        np.ascontiguousarray(qkv[:, v0:]).reshape(L * nkv, dv), v_run, dtype
    ).reshape(L, -1)
    no_norm = np.zeros(0)
    return dense_attention(held_qkv, nh, nkv, dk, dv, no_norm, no_norm, np.zeros(dk // 2), True,
                           dk**-0.5, window, False)  # fmt: skip


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("window, dk, dv", [(0, 128, 64), (24, 64, 32)])
def test_attention_reads_back_the_quantized_values(dtype, window, dk, dv):
    # Prefill of eleven sequences (one longer than a key chunk), then a step of ten decoding
    # tokens (an item takes every KV head) beside a prefill chunk that continues its sequence.
    # Values rotated over runs of 64, then of 32.
    nh, nkv = 8, 2
    rng = np.random.default_rng(window)
    lengths = [int(n) for n in rng.integers(2, 50, 10)] + [SPLIT_BLOCKS * BLOCK_SIZE + 70]
    split = [n - 1 for n in lengths[:-1]] + [lengths[-1] - 30]
    qkvs = [head_rows(rng, n, nh, nkv, dk, dv) for n in lengths]
    cache = Cache(lengths, nkv, dk, dv, dtype)
    got = [np.zeros((n, nh * dv), np.float32) for n in lengths]
    for phase in ([(s, 0, split[s]) for s in range(len(lengths))],
                  [(s, split[s], n) for s, n in enumerate(lengths)]):  # fmt: skip
        out, _ = cache.attend(
            np.concatenate([qkvs[s][a:b] for s, a, b in phase]), phase, nh, window
        )
        i = 0
        for s, a, b in phase:
            got[s][a:b], i = out[i : i + b - a], i + b - a
    for s in range(len(lengths)):
        want = ref_attention(qkvs[s], nh, nkv, dk, dv, dtype, window)
        np.testing.assert_allclose(got[s], want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("window", [0, 45])
def test_a_tokens_bits_do_not_depend_on_how_its_sequence_was_split(window):
    # What batch-invariant mode relies on, with a q8_0 cache: one prefill, token by token, or
    # chunks (other tiles, one key chunk or two) give the same bits, with RoPE and the
    # cache's Hadamard rotation on.
    nh, nkv, dk, n = 4, 2, 64, SPLIT_BLOCKS * BLOCK_SIZE + 40
    qkv = np.random.default_rng(window).standard_normal((n, (nh + 2 * nkv) * dk), np.float32)
    inv_freq = 10000.0 ** (-np.arange(0, dk, 2) / dk)

    def run(chunks):
        cache, out, a = Cache([n], nkv, dk, dk, "q8_0"), np.empty((n, nh * dk), np.float32), 0
        for size in chunks:
            out[a : a + size] = cache.attend(qkv[a : a + size], [(0, a, a + size)], nh, window,
                                             inv_freq)[0]  # fmt: skip
            a += size
        return out

    whole = run([n])
    np.testing.assert_array_equal(run([1] * n), whole)
    np.testing.assert_array_equal(run([37, 5, 60, 1, n - 103]), whole)


def test_a_cache_of_other_shapes_is_refused():
    cache = Cache([12], 1, 64, 64, "q8_0")
    kq, ks = cache.kv.k[0]
    cache.kv.k[0] = (kq, ks[:, :, :1])  # one scale for 64 values
    with pytest.raises(ValueError, match="do not match"):
        cache.attend(np.zeros((12, 3 * 64), np.float32), [(0, 0, 12)], 1)
    cache.kv.k[0] = (kq.view(np.uint16), ks)
    with pytest.raises(ValueError, match="int8"):
        cache.attend(np.zeros((12, 3 * 64), np.float32), [(0, 0, 12)], 1)


def test_heads_that_are_not_whole_groups_are_refused():
    with pytest.raises(ConfigError, match="multiples of 32"):
        KVCache(1, 2, 16, 16, 4, dtype="q8_0")
    KVCache(1, 2, 16, 16, 4, dtype="f16")  # a float cache takes any head dim


@pytest.fixture(scope="module")
def llama(synthetic_model):
    return synthetic_model("llama", "F32")


@pytest.mark.parametrize("dtype, ratio", [("q8_0", 34 / 64), ("q4_0", 18 / 64)])
def test_the_memory_plan_counts_the_bytes_the_cache_allocates(llama, dtype, ratio):
    with read_gguf(llama) as g:
        cfg = ModelConfig.from_gguf(g)
        f16 = memory_plan.plan(cfg, g, ctx=100, parallel=3, kv_dtype="f16")
        quant = memory_plan.plan(cfg, g, ctx=100, parallel=3, kv_dtype=dtype)
    assert quant.kv_bytes == f16.kv_bytes * ratio
    assert quant.kv_bytes_per_token == f16.kv_bytes_per_token * ratio
    assert quant.max_ctx >= f16.max_ctx
    blocks, _ = memory_plan.kv_pools(cfg, 100, 3, dtype)
    kv = KVCache.for_model(cfg, blocks, dtype)
    assert kv.nbytes == quant.kv_bytes == blocks * memory_plan.kv_block_bytes(cfg, dtype)
    budget, _ = memory_plan.kv_pools(cfg, 100, 3, dtype, kv_budget=kv.nbytes)
    assert budget == blocks  # a --kv-budget buys blocks at the quantized size


def test_a_batch_with_a_q8_0_cache_gives_each_request_its_tokens_alone(llama):
    # batch invariance and prefix caching with a quantized cache: the shared prefix's blocks are
    # reused, and every request gets the tokens it gets alone
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 300, 40).tolist()
    batch = [
        shared * (i % 2) + rng.integers(0, 300, n).tolist() for i, n in enumerate([3, 50, 9, 33])
    ]
    llm = LLM(
        str(llama), threads=1, max_num_batched_tokens=64, batch_invariant=True, kv_dtype="q8_0"
    )
    got = [c.token_ids for c in llm.generate(batch, greedy)]
    assert llm.stats().prefix_cache_hit_tokens > 0
    alone = LLM(str(llama), threads=1, prefix_caching=False, batch_invariant=True, kv_dtype="q8_0")
    assert got == [alone.generate(p, greedy)[0].token_ids for p in batch]


def test_a_quantized_cache_is_refused_on_layers_ggml_runs(llama):
    with pytest.raises(EdgeInferError, match="f16 or f32"):
        LLM(str(llama), threads=1, ctx=64, kv_dtype="q8_0", offload="all@cpu")


def mean_kl(ref, logits) -> float:
    return float(kl(ref, np.asarray(logits, np.float64)).mean())


def test_a_q8_0_cache_is_as_close_to_exact_math_as_llama_cpps(synthetic_model):
    # design.md section 9: the float64 reference pass is the oracle. With F32 weights neither
    # engine rounds activations, so the cache is what separates them from exact math; llama.cpp
    # needs flash attention for a quantized V cache.
    path = synthetic_model("qwen3", "F32")
    tokens = np.random.default_rng(3).integers(0, 300, 60).tolist()
    ref = ReferenceModel(path).logits(tokens)
    ours, theirs = {}, {}
    for dtype, type_id in GGML_TYPE_IDS.items():
        ours[dtype] = mean_kl(ref, LLM(str(path), threads=2, ctx=64, kv_dtype=dtype).logits(tokens))
        cpp = oracle(path, 64, type_k=type_id, type_v=type_id, flash_attn=True)
        theirs[dtype] = mean_kl(ref, oracle_logits(cpp, tokens))
    print(f"KL to exact math, edgeinfer {ours}, llama.cpp {theirs}")
    assert ours["f16"] < ours["q8_0"] < ours["q4_0"]  # the cache really is quantized
    assert ours["q8_0"] <= theirs["q8_0"]
    assert ours["q4_0"] <= theirs["q4_0"] * 1.1


def test_run_takes_kv_dtype(llama):
    # the flag reaches the cache (run's KV line names it), and a bad one is one clear line
    ok = cli("run", str(llama), "-p", "a b c", "-n", "3", "--ctx", "64", "--kv-dtype", "q8_0")
    assert ok.returncode == 0, ok.stderr
    assert "q8_0 (ctx 64" in ok.stderr
    assert_clean_error(cli("run", str(llama), "-p", "a", "--kv-dtype", "q5"), "q8_0")
