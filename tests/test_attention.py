"""Paged self-attention against dense numpy attention written from the definition.

Several sequences of different lengths share one block pool through shuffled block tables;
a batch mixes prefill and decode tokens; GQA, QK-norm, both RoPE layouts, sliding windows,
float16 and float32 caches, and the split-key (flash-decoding) path for a lone long query.
"""

import numpy as np
import pytest

from edgeinfer.kernels.attention import (
    HEADS_TOGETHER_MIN,
    KEPT_BYTES,
    SPLIT_BLOCKS,
    _plan,
    self_attention,
)
from edgeinfer.kernels.rope import rope_inv_freq

BS = 16


def ref_norm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def ref_rope(x, positions, inv_freq, neox):
    # x: [n, h, d] float64
    half = inv_freq.size
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half : 2 * half]
        out[..., :half], out[..., half : 2 * half] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = a * c - b * s, a * s + b * c
    return out


def ref_attention(qkv, nh, nkv, dk, dv, q_norm, k_norm, inv_freq, neox, scale, window, f16):
    """One sequence's full history: qkv [L, width] -> [L, nh * dv]."""
    L = qkv.shape[0]
    pos = np.arange(L)
    q = qkv[:, : nh * dk].reshape(L, nh, dk).astype(np.float64)
    k = qkv[:, nh * dk : (nh + nkv) * dk].reshape(L, nkv, dk).astype(np.float64)
    v = qkv[:, (nh + nkv) * dk :].reshape(L, nkv, dv).astype(np.float64)
    if q_norm.size:
        q, k = ref_norm(q, q_norm, 1e-6), ref_norm(k, k_norm, 1e-6)
    q = ref_rope(q, pos, inv_freq, neox) * scale
    k = ref_rope(k, pos, inv_freq, neox)
    if f16:
        k = k.astype(np.float16).astype(np.float64)
        v = v.astype(np.float16).astype(np.float64)
    G = nh // nkv
    out = np.zeros((L, nh, dv))
    for t in range(L):
        lo = max(0, t - window + 1) if window else 0
        for h in range(nh):
            s = k[lo : t + 1, h // G] @ q[t, h]
            p = np.exp(s - s.max())
            out[t, h] = p @ v[lo : t + 1, h // G] / p.sum()
    return out.reshape(L, nh * dv)


class Paged:
    """A shuffled block pool and per-sequence tables, as the runner builds them."""

    def __init__(self, lengths, nkv, dk, dv, dtype, rng, bs=BS):
        self.bs = bs
        n_blocks = sum(-(-n // bs) for n in lengths) + 3
        perm = rng.permutation(n_blocks)
        self.tables = np.zeros((len(lengths), max(-(-n // bs) for n in lengths)), np.int32)
        used = 0
        for s, n in enumerate(lengths):
            nb = -(-n // bs)
            self.tables[s, :nb] = perm[used : used + nb]
            used += nb
        self.k = np.zeros((n_blocks, nkv, dk, bs), dtype)
        self.v = np.zeros((n_blocks, nkv, bs, dv), dtype)

    def batch(self, spans):
        """spans: [(seq, start, stop)] -> (seq_rows, positions, slots) for those tokens."""
        rows, pos = [], []
        for s, a, b in spans:
            rows += [s] * (b - a)
            pos += list(range(a, b))
        rows, pos = np.array(rows, np.int32), np.array(pos, np.int32)
        bs = self.bs
        slots = self.tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        return rows, pos, slots


def run_case(rng, nh, nkv, dk, dv, qk_norm, neox, window, dtype, lengths, split_at):
    width = (nh + nkv) * dk + nkv * dv
    qkvs = [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]
    q_norm = rng.standard_normal(dk).astype(np.float32) if qk_norm else np.zeros(0, np.float32)
    k_norm = rng.standard_normal(dk).astype(np.float32) if qk_norm else np.zeros(0, np.float32)
    inv_freq = rope_inv_freq(dk, 10000.0)
    scale = dk**-0.5
    cache = Paged(lengths, nkv, dk, dv, dtype, rng)
    got = [np.zeros((n, nh * dv), np.float32) for n in lengths]
    # Two calls: everything before split_at[s] (prefill), then the rest of every sequence.
    for phase in range(2):
        spans = [
            (s, 0, split_at[s]) if phase == 0 else (s, split_at[s], n)
            for s, n in enumerate(lengths)
        ]
        spans = [sp for sp in spans if sp[2] > sp[1]]
        rows, pos, slots = cache.batch(spans)
        qkv = np.concatenate([qkvs[s][a:b] for s, a, b in spans])
        out = self_attention(
            qkv, q_norm, k_norm, 1e-6, inv_freq, neox, scale, window,
            cache.k, cache.v, cache.tables, rows, pos, slots, nh,
        )  # fmt: skip
        i = 0
        for s, a, b in spans:
            got[s][a:b] = out[i : i + b - a]
            i += b - a
    for s in range(len(lengths)):
        want = ref_attention(
            qkvs[s], nh, nkv, dk, dv, q_norm, k_norm, inv_freq, neox, scale, window,
            dtype == np.uint16,
        )  # fmt: skip
        np.testing.assert_allclose(got[s], want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize(
    "nh, nkv, qk_norm, neox, window",
    [
        (4, 2, False, False, 0),
        (6, 1, True, True, 0),
        (4, 4, False, True, 20),
        (8, 2, True, False, 7),
    ],
)
def test_batched_sequences(dtype, nh, nkv, qk_norm, neox, window):
    rng = np.random.default_rng(nh * 10 + nkv + window)
    # Prefill of different lengths (one crossing several blocks), then a mixed batch: decode
    # steps, a second prefill chunk, and a sequence that only starts in phase two.
    run_case(
        rng, nh, nkv, 32, 32, qk_norm, neox, window, dtype,
        lengths=[40, 17, 5, 3], split_at=[39, 16, 1, 0],
    )  # fmt: skip


@pytest.mark.parametrize("window", [0, 100])
def test_single_long_query_split_keys(window):
    # One token attending to 1070 positions: keys split into three chunks, the window across a
    # chunk boundary.
    rng = np.random.default_rng(window)
    n = 2 * SPLIT_BLOCKS * BS + 46
    run_case(rng, 4, 1, 64, 64, False, True, window, np.uint16, lengths=[n], split_at=[n - 1])


def test_value_head_dim_differs():
    rng = np.random.default_rng(7)
    run_case(rng, 4, 2, 32, 16, False, True, 0, np.float32, lengths=[20, 9], split_at=[10, 8])


@pytest.mark.parametrize("dtype", [np.uint16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("window", [0, 24])
def test_many_decodes_with_a_prefill_chunk(dtype, window):
    # The engine's step: 12 sequences decode one token each (one per item, rows written
    # straight to the output) next to a 70-token prefill chunk that continues its sequence.
    rng = np.random.default_rng(window + 3)
    lengths = [int(x) for x in rng.integers(2, 60, 12)] + [110]
    split_at = [n - 1 for n in lengths[:-1]] + [40]
    run_case(rng, 9, 3, 64, 64, False, False, window, dtype, lengths, split_at)


def test_decode_gqa_one_kv_head_long_window():
    # gemma3's shape: head dim 256, one KV head, a window shorter than some sequences.
    rng = np.random.default_rng(11)
    run_case(
        rng, 4, 1, 256, 256, True, True, 40, np.uint16,
        lengths=[90, 30, 57, 41], split_at=[89, 29, 56, 40],
    )  # fmt: skip


@pytest.mark.parametrize("window", [0, 20, 45])
@pytest.mark.parametrize("bs", [16, 32])
def test_a_tokens_bits_do_not_depend_on_how_its_sequence_was_split(bs, window):
    # What a batch-invariant engine relies on: a token's output is the same bits whether its
    # sequence came in one prefill, in chunks or one token at a time (other tiles, other chunk
    # lengths, one key chunk or three, its prefill's tiles in one wave or in several: see
    # KEPT_BYTES), also with two rows of 16 keys per block.
    rng = np.random.default_rng(bs + window)
    nh, nkv, dk, n = 4, 2, 32, 2 * SPLIT_BLOCKS * bs + 40
    qkv = rng.standard_normal((n, (nh + 2 * nkv) * dk)).astype(np.float32)
    none = np.zeros(0, np.float32)
    inv_freq = rope_inv_freq(dk, 10000.0)

    def run(chunks, kept_bytes=KEPT_BYTES):
        cache = Paged([n], nkv, dk, dk, np.uint16, np.random.default_rng(0), bs)
        out, a = np.empty((n, nh * dk), np.float32), 0
        for size in chunks:
            rows, pos, slots = cache.batch([(0, a, a + size)])
            out[a : a + size] = self_attention(
                qkv[a : a + size].copy(), none, none, 1e-6, inv_freq, True, dk**-0.5, window,
                cache.k, cache.v, cache.tables, rows, pos, slots, nh, kept_bytes,
            )  # fmt: skip
            a += size
        return out

    whole = run([n])
    np.testing.assert_array_equal(run([n], kept_bytes=1), whole)  # a wave a tile
    np.testing.assert_array_equal(run([n], kept_bytes=60_000), whole)  # a few tiles a wave
    np.testing.assert_array_equal(run([1] * n), whole)
    np.testing.assert_array_equal(run([37, 5, 60, 1, n - 103]), whole)


@pytest.mark.parametrize("window", [0, 30])
def test_a_decode_tokens_bits_do_not_depend_on_its_items_heads(window):
    # Decoding next to enough other sequences, a token's item covers all KV heads; alone, one
    # KV head per item. Both give the same bits.
    rng = np.random.default_rng(window + 5)
    nh, nkv, dk = 9, 3, 32
    lengths = [int(x) for x in rng.integers(20, 700, HEADS_TOGETHER_MIN + 1)]
    qkvs = [rng.standard_normal((n, (nh + 2 * nkv) * dk)).astype(np.float32) for n in lengths]
    none = np.zeros(0, np.float32)
    inv_freq = rope_inv_freq(dk, 10000.0)
    cache = Paged(lengths, nkv, dk, dk, np.uint16, np.random.default_rng(0))

    def attend(spans):
        rows, pos, slots = cache.batch(spans)
        qkv = np.concatenate([qkvs[s][a:b] for s, a, b in spans])
        items = _plan(rows, pos, window, BS, nkv)[3]
        heads = set((items[:, 2] - items[:, 1]).tolist())
        out = self_attention(
            qkv, none, none, 1e-6, inv_freq, True, dk**-0.5, window, cache.k, cache.v,
            cache.tables, rows, pos, slots, nh,
        )  # fmt: skip
        return out, heads

    for s, n in enumerate(lengths):
        attend([(s, 0, n - 1)])
    together, heads = attend([(s, n - 1, n) for s, n in enumerate(lengths)])
    assert heads == {nkv}
    for s, n in enumerate(lengths):
        alone, heads = attend([(s, n - 1, n)])
        assert heads == {1}
        np.testing.assert_array_equal(alone[0], together[s])


def attend_once(cache, rng):
    """One 12-token prefill of one sequence (1 KV head, head dim 16) through cache.k, cache.v."""
    rows, pos, slots = cache.batch([(0, 0, 12)])
    none = np.zeros(0, np.float32)
    qkv = rng.standard_normal((12, 3 * 16)).astype(np.float32)
    return self_attention(
        qkv, none, none, 1e-6, rope_inv_freq(16, 10000.0), True, 0.25, 0,
        cache.k, cache.v, cache.tables, rows, pos, slots, 1,
    )  # fmt: skip


def test_a_block_size_the_tiles_cannot_cover_is_refused():
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match="multiple of 16"):
        attend_once(Paged([12], 1, 16, 16, np.uint16, rng, bs=12), rng)


def test_a_k_cache_in_the_value_layout_is_refused():
    # keys stored as rows ([blocks, heads, block_size, head_dim]) would be read as columns
    rng = np.random.default_rng(6)
    cache = Paged([12], 1, 32, 16, np.uint16, rng)
    cache.k = np.zeros((cache.k.shape[0], 1, 16, 32), np.uint16)
    with pytest.raises(ValueError, match="does not match V cache"):
        attend_once(cache, rng)


def test_a_cache_that_is_not_contiguous_is_refused():
    # blocks are read by flat offset: a strided view would be read as the wrong values
    rng = np.random.default_rng(7)
    cache = Paged([12], 1, 16, 16, np.float32, rng)
    cache.v = np.zeros((cache.v.shape[0], 1, 16, 32), np.float32)[..., ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        attend_once(cache, rng)
