"""Exact math: a float64 forward pass from a GGUF file's dequantized weights, the accuracy oracle.

Written from the architectures' definitions (Hugging Face's LlamaForCausalLM, Qwen2/Qwen3,
Gemma3ForCausalLM) in GGUF's tensor layout, independent of edgeinfer's model code: the weights
are dequantized with gguf.quants (exact: every dequantized weight is a float32 number), the
hyperparameters are read from the metadata here, and every product, norm and softmax is float64.
What such a pass computes from a quantized file is that file's exact output, so the distance of
an engine's logits from it is the engine's own arithmetic error, nothing else.

GGUF specifics: llama's Q/K rows are permuted at conversion for ggml's "normal" RoPE (rotating
adjacent pairs); the other architectures rotate the two halves (NeoX). Gemma's norm weights are
stored as 1 + w already.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import quants

from edgeinfer.gguf.reader import read_gguf

GEMMA3_SLIDING_PATTERN = 6  # llama.cpp / HF default: every 6th layer is global
GEMMA3_ROPE_LOCAL_BASE = 10000.0


class ReferenceModel:
    """model = ReferenceModel(path); model.logits(token_ids) -> float64[n, vocab]."""

    def __init__(self, path):
        self.g = read_gguf(path)
        m = self.g.metadata
        self.arch = a = m["general.architecture"]
        if a not in ("llama", "qwen2", "qwen3", "gemma3"):
            raise ValueError(f"no reference for architecture {a}")
        self.n_layers = m[f"{a}.block_count"]
        self.n_embd = m[f"{a}.embedding_length"]
        self.n_heads = m[f"{a}.attention.head_count"]
        self.n_kv = m.get(f"{a}.attention.head_count_kv", self.n_heads)
        self.head_dim = m.get(f"{a}.attention.key_length", self.n_embd // self.n_heads)
        self.eps = m[f"{a}.attention.layer_norm_rms_epsilon"]
        self.rope_base = m.get(f"{a}.rope.freq_base", 10000.0)
        self.rope_dim = m.get(f"{a}.rope.dimension_count", self.head_dim)
        self.window = m.get(f"{a}.attention.sliding_window") if a == "gemma3" else None
        self.pattern = m.get(f"{a}.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        self.local_base = m.get(f"{a}.rope.freq_base_swa", GEMMA3_ROPE_LOCAL_BASE)
        self.softcap = m.get(f"{a}.final_logit_softcapping") if a == "gemma3" else None
        # Gemma 3 scales queries by query_pre_attn_scalar**-0.5 = key_length**-0.5 (27B aside)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def w(self, name: str) -> np.ndarray | None:
        """A tensor dequantized exactly (float32 values), or None if the file lacks it."""
        info = self.g.tensors.get(name)
        if info is None:
            return None
        data = self.g.tensor_data(name)
        return quants.dequantize(data, info.qtype).reshape(info.shape)

    def _rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * weight

    def _rope(self, x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
        # x: [n, heads, head_dim], rotating the first rope_dim dims of each head
        d = self.rope_dim
        inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        factors = self.w("rope_freqs.weight")  # llama3-style per-frequency divisors
        if factors is not None:
            inv = inv / factors
        ang = pos[:, None, None] * inv[None, None, :]  # [n, 1, d/2]
        cos, sin = np.cos(ang), np.sin(ang)
        out = x.copy()
        if self.arch == "llama":  # adjacent pairs
            a, b = x[..., 0:d:2], x[..., 1:d:2]
            out[..., 0:d:2] = a * cos - b * sin
            out[..., 1:d:2] = a * sin + b * cos
        else:  # halves
            a, b = x[..., : d // 2], x[..., d // 2 : d]
            out[..., : d // 2] = a * cos - b * sin
            out[..., d // 2 : d] = a * sin + b * cos
        return out

    def _sliding(self, layer: int) -> bool:
        return bool(self.window) and layer % self.pattern < self.pattern - 1

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w(name + ".weight").astype(np.float64).T
        bias = self.w(name + ".bias")
        return y if bias is None else y + bias

    def logits(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        n = len(ids)
        pos = np.arange(n, dtype=np.float64)
        emb = self.w("token_embd.weight")
        x = emb[ids].astype(np.float64)
        gemma = self.arch == "gemma3"
        if gemma:
            x = x * math.sqrt(self.n_embd)
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        for layer in range(self.n_layers):
            p = f"blk.{layer}."
            h = self._rms(x, self.w(p + "attn_norm.weight"))
            q = self._linear(h, p + "attn_q").reshape(n, nh, hd)
            k = self._linear(h, p + "attn_k").reshape(n, nkv, hd)
            v = self._linear(h, p + "attn_v").reshape(n, nkv, -1)
            if self.arch in ("qwen3", "gemma3"):
                q = self._rms(q, self.w(p + "attn_q_norm.weight"))
                k = self._rms(k, self.w(p + "attn_k_norm.weight"))
            sliding = self._sliding(layer)
            base = self.local_base if sliding else self.rope_base
            q, k = self._rope(q, pos, base), self._rope(k, pos, base)
            allowed = j <= i
            if sliding:
                allowed &= i - j < self.window
            group = nh // nkv
            heads = []
            for hh in range(nh):
                s = (q[:, hh] @ k[:, hh // group].T) * self.scale
                s = np.where(allowed, s, -np.inf)
                s = np.exp(s - s.max(-1, keepdims=True))
                heads.append((s / s.sum(-1, keepdims=True)) @ v[:, hh // group])
            o = self._linear(np.concatenate(heads, axis=-1), p + "attn_output")
            if gemma:
                o = self._rms(o, self.w(p + "post_attention_norm.weight"))
            x = x + o
            h = self._rms(x, self.w(p + "ffn_norm.weight"))
            gate, up = self._linear(h, p + "ffn_gate"), self._linear(h, p + "ffn_up")
            if gemma:  # GELU, tanh approximation
                c = math.sqrt(2 / math.pi)
                act = 0.5 * gate * (1 + np.tanh(c * (gate + 0.044715 * gate**3)))
            else:  # SiLU
                act = gate / (1 + np.exp(-gate))
            f = self._linear(act * up, p + "ffn_down")
            if gemma:
                f = self._rms(f, self.w(p + "post_ffw_norm.weight"))
            x = x + f
        x = self._rms(x, self.w("output_norm.weight"))
        head = self.w("output.weight")
        head = emb if head is None else head
        logits = np.empty((n, head.shape[0]))
        for r in range(0, head.shape[0], 16384):  # bounded float64 copies of a big vocabulary
            logits[:, r : r + 16384] = x @ head[r : r + 16384].astype(np.float64).T
        bias = self.w("output.bias")
        if bias is not None:
            logits += bias
        if self.softcap:
            logits = self.softcap * np.tanh(logits / self.softcap)
        return logits
