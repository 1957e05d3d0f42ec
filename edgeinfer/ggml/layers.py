"""The decoder block as a ggml graph, with the same architecture features as models/base.py:
optional biases (qwen2, llama), QK-norm (qwen3, gemma3), normal or NeoX RoPE, SwiGLU or GeGLU,
sandwich post-norms (gemma3), sliding-window layers (gemma3, through their own mask). What a
model has is decided by the model (its hooks and its file), read once into `Facts` and
`LayerNodes`; nothing here branches on an architecture's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.kernels.activations import GELU_TANH

from .graph import Builder, Node
from .lib import ROPE_NEOX

# The block's tensors by role -> GGUF name suffix (llama.cpp's names; models/layout.py says
# which an architecture has, and ModelConfig has checked the file against it).
MATRICES = {
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
VECTORS = {
    "attn_norm": "attn_norm.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "bo": "attn_output.bias",
    "post_attn_norm": "post_attention_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "b_gate": "ffn_gate.bias",
    "b_up": "ffn_up.bias",
    "b_down": "ffn_down.bias",
    "post_ffn_norm": "post_ffw_norm.weight",
}


@dataclass(frozen=True)
class Facts:
    """What every layer of the model shares, read from its config and hooks."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_dim: int
    eps: float
    attn_scale: float
    rope_mode: int  # 0: normal (pairs 2i, 2i+1), ROPE_NEOX: pairs (i, i + n/2)
    gelu: bool  # GeGLU (tanh GELU) instead of SwiGLU

    @classmethod
    def of(cls, model) -> Facts:
        c = model.config
        return cls(
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.v_head_dim,
            c.rope_dim,
            c.norm_eps,
            c.attn_scale,
            ROPE_NEOX if model.rope_neox else 0,
            model.activation == GELU_TANH,
        )


@dataclass
class LayerNodes:
    """One layer's weights on the backend; a role the file lacks is None."""

    mats: dict[str, Node]
    vecs: dict[str, Node | None]
    rope_factors: Node  # f32[rope_dim / 2]
    window: int  # sliding window, 0: full attention


def rope_factors(inv_freq: np.ndarray, rope_dim: int) -> np.ndarray:
    """The per-pair divisors that make ggml's RoPE (freq_base 10000, freq_scale 1) turn by
    exactly the model's inv_freq (models' layer_geometry, where every scaling is already
    folded in): ggml's angle is pos * 10000^(-2i/n) / factor[i], with the power taken as it
    takes it, by repeated float32 products."""
    step = np.float32(10000.0 ** (-2.0 / rope_dim))
    theta = np.empty(len(inv_freq), np.float32)
    t = np.float32(1.0)
    for i in range(len(inv_freq)):
        theta[i] = t
        t = np.float32(t * step)
    return (theta.astype(np.float64) / inv_freq).astype(np.float32)


def _linear(b: Builder, w: Node, bias: Node | None, x: Node) -> Node:
    y = b.mul_mat(w, x)
    return y if bias is None else b.add(y, bias)


def _norm(b: Builder, x: Node, w: Node | None, eps: float) -> Node:
    return x if w is None else b.mul(b.rms_norm(x, eps), w)


def attention(b: Builder, L: LayerNodes, f: Facts, h: Node, io: dict, kc: Node, vc: Node) -> Node:
    """h: [d, n] (normed) -> [n_heads * v_head_dim, n]; writes the tokens' K/V at io['rows']."""
    m, v = L.mats, L.vecs
    n = h.ne[1]
    q = b.reshape(_linear(b, m["wq"], v["bq"], h), f.head_dim, f.n_heads, n)
    k = b.reshape(_linear(b, m["wk"], v["bk"], h), f.head_dim, f.n_kv_heads, n)
    val = _linear(b, m["wv"], v["bv"], h)  # [kv_heads * v_head_dim, n]
    q = _norm(b, q, v["q_norm"], f.eps)
    k = _norm(b, k, v["k_norm"], f.eps)
    q = b.rope(q, io["pos"], L.rope_factors, f.rope_dim, f.rope_mode)
    k = b.rope(k, io["pos"], L.rope_factors, f.rope_dim, f.rope_mode)
    kc = b.set_rows(kc, b.reshape(k, f.head_dim * f.n_kv_heads, n), io["rows"])
    vc = b.set_rows(vc, val, io["rows"])
    nkv = io["n_rows"]
    if "kv_idx" in io:  # the rows gathered in the sequence's order (batch-invariant mode)
        keys = b.reshape(b.get_rows(kc, io["kv_idx"]), f.head_dim, f.n_kv_heads, nkv)
        values = b.reshape(b.get_rows(vc, io["kv_idx"]), f.v_head_dim, f.n_kv_heads, nkv)
    else:  # the cache's first nkv rows, in block order
        keys = b.rows_view(kc, f.head_dim, f.n_kv_heads, nkv)
        values = b.rows_view(vc, f.v_head_dim, f.n_kv_heads, nkv)
    keys, values = b.permute_0213(keys), b.permute_0213(values)
    mask = io["mask_swa"] if L.window else io["mask"]
    out = b.flash_attn(b.permute_0213(q), keys, values, mask, f.attn_scale)
    return b.reshape(out, f.v_head_dim * f.n_heads, n)


def block(
    b: Builder, L: LayerNodes, f: Facts, x: Node, io: dict, kc: Node, vc: Node, keep: Node | None
) -> Node:
    """x: [d, n] residual -> the residual after the layer. keep: int32[m] rows to carry past
    the attention (the head's rows, in the last layer), or None for all."""
    m, v = L.mats, L.vecs
    attn = attention(b, L, f, _norm(b, x, v["attn_norm"], f.eps), io, kc, vc)
    o = _norm(b, _linear(b, m["wo"], v["bo"], attn), v["post_attn_norm"], f.eps)
    if keep is not None:  # only the rows whose logits are wanted need the FFN and the head
        x, o = b.get_rows(x, keep), b.get_rows(o, keep)
    x = b.add(x, o)
    h = _norm(b, x, v["ffn_norm"], f.eps)
    gate = _linear(b, m["w_gate"], v["b_gate"], h)
    up = _linear(b, m["w_up"], v["b_up"], h)
    ffn = _linear(b, m["w_down"], v["b_down"], b.glu(gate, up, f.gelu))
    return b.add(x, _norm(b, ffn, v["post_ffn_norm"], f.eps))


def head(b: Builder, norm: Node, w: Node, bias: Node | None, x: Node, eps: float) -> Node:
    """x: [d, m] -> logits [vocab, m] (before any softcap: the model applies that)."""
    return _linear(b, w, bias, _norm(b, x, norm, eps))
