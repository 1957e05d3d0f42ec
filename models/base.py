"""What the decoder-only architectures share: weight loading, the pre-norm block, the forward pass.

An architecture file subclasses `DecoderModel` and states only how it differs: RoPE layout,
FFN activation, embedding scale, per-layer attention geometry (sliding window, RoPE base).
Optional tensors (biases, QK-norms, post-norms) are loaded when the file has them;
`ModelConfig.from_gguf` has already checked that the file holds exactly the tensors its
architecture allows, with the right shapes.

Quantization is a property of the weight objects (`kernels.QuantWeight`): nothing here branches
on a tensor type. Projections that read the same input (Q/K/V, gate/up) become one weight
when the file stores them back to back with one type, so one matmul serves them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgeinfer import kernels
from edgeinfer.config import FFN_PIECE_COLS, FFN_PIECES_FROM
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import GGUFFile
from edgeinfer.kernels.activations import SILU, gated_act, softcap_
from edgeinfer.kernels.attention import self_attention
from edgeinfer.kernels.norm import add_rms_norm, rms_norm
from edgeinfer.kernels.rope import rope_inv_freq
from edgeinfer.models.layout import tensor_shapes

if TYPE_CHECKING:
    from edgeinfer.ggml.placement import Span

_NONE = np.zeros(0, np.float32)  # "absent" for optional norm weights and biases in kernels


@dataclass
class Batch:
    """A flat batch of tokens from one or more sequences, laid out by the runner.

    token_ids, positions: int32[n]; seq_rows: int32[n], each token's row of block_tables;
    slots: int64[n], where each token's K/V go (block * block_size + offset);
    block_tables: int32[n_seqs, max_blocks]; logit_rows: int64[m], the tokens whose logits are
    wanted, strictly increasing (None: all n; m = n is all n too); row_wise: every matmul takes
    `kernels.matmul`'s row-wise path, so that each sequence gets the same bits whatever it is
    batched with (False: the path is chosen by the batch size; ROW_WISE_INT8: row-wise with
    int8 activations where the type gains by it, the fast path for prompt rows; ROW_WISE_EXACT:
    row-wise with float activations for every type, precision "exact").
    window_slots, window_block_tables: the same in the sliding-window pool, whose layers
    (KVCache.window_layers) take them instead (None: no such pool).
    """

    token_ids: np.ndarray
    positions: np.ndarray
    seq_rows: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray
    logit_rows: np.ndarray | None = None
    row_wise: bool | str = False
    window_slots: np.ndarray | None = None
    window_block_tables: np.ndarray | None = None


ROW_WISE_INT8 = "int8"  # Batch.row_wise: each row on its own, its activations rounded to int8
ROW_WISE_EXACT = "exact"  # Batch.row_wise: each row on its own, float activations only


class Linear:
    """y = x · Wᵀ (+ b) for W made of one or more row-stacked weights -> [n, sum of outs]."""

    def __init__(self, parts: list[kernels.QuantWeight], bias: np.ndarray | None = None):
        self.parts = parts
        self.bias = bias
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        # Decode-sized calls go straight to the fused kernel, and row-wise calls (every engine
        # step) to the row-tile kernel, one weight or stacked parts alike (parts of one type
        # that the file does not store back to back, Q, K, V, still share one kernel launch;
        # parts of two types, one launch per type): a step makes about four per layer, and the
        # general path's dispatch by n costs a third of a small call.
        unit = parts[0].unit
        small = kernels.bind_small(parts)
        self.small, self._small_n_max = small if small is not None else (None, -1)
        self.row_wise = kernels.bind_row_wise(parts)
        self.row_int8 = kernels.bind_row_wise(parts, int8=True)
        # above small_n_max, up to rows_n_max: the int8 GEMM where kernels.matmul takes it
        self._int8_n_max = unit.rows_n_max if kernels.takes_int8_rows(unit) else -1
        self.row_exact = kernels.bind_row_wise(parts, exact=True)

    def __call__(self, x: np.ndarray, row_wise: bool | str = False) -> np.ndarray:
        if row_wise == ROW_WISE_INT8:
            y = self.row_int8(x)
        elif row_wise == ROW_WISE_EXACT:
            y = self.row_exact(x)
        elif row_wise:
            y = self.row_wise(x)
        elif x.shape[0] <= self._small_n_max:
            y = self.small(x)
        elif x.shape[0] <= self._int8_n_max:
            y = self.row_int8(x)
        elif len(self.parts) == 1:
            y = kernels.matmul(x, self.parts[0])
        else:
            y = np.concatenate([kernels.matmul(x, p) for p in self.parts], axis=1)
        if self.bias is not None:
            y += self.bias
        return y


@dataclass
class Layer:
    # d = n_embd, dk/dv = head dims; optional weights are float32[0] when absent
    attn_norm: np.ndarray  # [d]
    qkv: Linear  # [(nh + nkv) * dk + nkv * dv, d]
    q_norm: np.ndarray  # [dk]
    k_norm: np.ndarray  # [dk]
    wo: Linear  # [d, nh * dv]
    post_attn_norm: np.ndarray  # [d]
    ffn_norm: np.ndarray  # [d]
    gate_up: Linear  # [2 * n_ff, d]
    gate_up_pieces: list[tuple[int, Linear]]  # (first FFN column c, [gate | up] of c .. c + m)
    down: Linear  # [d, n_ff]
    post_ffn_norm: np.ndarray  # [d]
    inv_freq: np.ndarray  # float64[rope_dim / 2]
    window: int  # sliding window in tokens, 0 = full attention


class WeightLoader:
    """Turns GGUF tensors into kernel-ready objects, reading only the tensors `layout` gives
    the architecture (a name outside it is a tensor the architecture does not have)."""

    def __init__(self, g: GGUFFile, config: ModelConfig):
        self.g = g
        required, optional = tensor_shapes(config)
        self.layout = required.keys() | optional.keys()

    def has(self, name: str) -> bool:
        return name in self.layout and name in self.g.tensors

    def vector(self, name: str) -> np.ndarray:
        """A norm weight or bias -> float32 copy; float32[0] when the model lacks it."""
        if not self.has(name):
            return _NONE
        info = self.g.tensors[name]
        return kernels.dequantize(self.g.tensor_data(name), info.qtype, info.shape).reshape(-1)

    def info(self, name: str):
        if name not in self.layout:
            raise KeyError(f"{name} is not in this architecture's layout (models/layout.py)")
        return self.g.tensors[name]

    def weight(self, name: str) -> kernels.QuantWeight:
        info = self.info(name)
        return kernels.QuantWeight.from_raw(self.g.tensor_data(name), info.qtype, info.shape)

    def linear(self, names: list[str], bias: bool = False) -> Linear:
        """Row-stack the named weights into as few matmuls as the file allows.

        Consecutive weights of one type that the file stores back to back become one weight,
        a zero-copy view of the mapping; the others stay separate matmuls. Copying them
        together would take them out of the page cache into anonymous memory (weights stay
        memory-mapped: at most 10 % may be repacked).
        """
        infos = [self.info(n) for n in names]
        parts = []
        i = 0
        while i < len(infos):
            j = i + 1
            while (
                j < len(infos)
                and infos[j].qtype == infos[i].qtype
                and self.g.contiguous_data(names[i : j + 1]) is not None
            ):
                j += 1
            group = infos[i:j]
            shape = (sum(t.shape[0] for t in group), group[0].shape[1])
            data = self.g.contiguous_data(names[i:j])
            parts.append(kernels.QuantWeight.from_raw(data, group[0].qtype, shape))
            i = j
        if not bias:
            return Linear(parts)
        return Linear(parts, _stacked_bias(self.biases(names), [t.shape[0] for t in infos]))

    def biases(self, names: list[str]) -> list[np.ndarray | None]:
        """The named weights' biases (None for a weight without one)."""
        return [self.vector(_bias_name(n)) if self.has(_bias_name(n)) else None for n in names]

    def gate_up_pieces(self, gate: str, up: str) -> list[tuple[int, Linear]]:
        """[gate | up] in ranges of FFN_PIECE_COLS of the FFN's columns, views of the file's rows
        (none when the FFN is one range)."""
        g, u = self.weight(gate), self.weight(up)
        n_ff = g.shape[0]
        if n_ff <= FFN_PIECE_COLS:
            return []
        biases = self.biases([gate, up])
        pieces = []
        for lo in range(0, n_ff, FFN_PIECE_COLS):
            hi = min(n_ff, lo + FFN_PIECE_COLS)
            bias = _stacked_bias([b if b is None else b[lo:hi] for b in biases], [hi - lo] * 2)
            pieces.append((lo, Linear([g.rows(lo, hi), u.rows(lo, hi)], bias)))
        return pieces


def _stacked_bias(biases: list[np.ndarray | None], rows: list[int]) -> np.ndarray | None:
    """The bias of row-stacked weights of `rows` rows each: each one's own bias, zeros for one
    without; None when none has one."""
    if all(b is None for b in biases):
        return None
    parts = [np.zeros(n) if b is None else b for b, n in zip(biases, rows, strict=True)]
    return np.concatenate(parts).astype(np.float32)


def _bias_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".bias"


class DecoderModel:
    """A pre-norm decoder-only transformer over a paged KV cache.

    Subclasses set `rope_neox` and `activation`, and may override `embedding_scale` and
    `layer_geometry` (per-layer RoPE frequencies and sliding window).
    """

    rope_neox: bool = False
    activation: int = SILU

    def __init__(self, g: GGUFFile, config: ModelConfig, offload: Span | None = None):
        """offload: layers (and maybe the head) that a ggml span executor will run: they are
        not loaded here (None in self.layers), and `attach` hands the executor over."""
        self.config = config
        self.offload = offload
        self.executor = None
        w = WeightLoader(g, config)
        self.tok_embd = w.weight("token_embd.weight")  # [vocab, d]
        self.output_norm = w.vector("output_norm.weight")
        self.output = None
        if offload is None or not offload.head:
            head = "token_embd.weight" if config.tied_output else "output.weight"
            self.output = Linear([self.tok_embd] if config.tied_output else [w.weight(head)])
            if w.has("output.bias"):
                self.output.bias = w.vector("output.bias")
        self.freq_factors = w.vector("rope_freqs.weight")
        host = range(config.n_layers) if offload is None else self.host_layers(offload)
        self.layers = [
            self._load_layer(w, i) if i in host else None for i in range(config.n_layers)
        ]

    def host_layers(self, offload: Span) -> list[int]:
        return [i for i in range(self.config.n_layers) if not offload.first <= i < offload.stop]

    def attach(self, executor) -> None:
        """The span executor for `self.offload` (edgeinfer.ggml.SpanExecutor)."""
        self.executor = executor

    def _load_layer(self, w: WeightLoader, i: int) -> Layer:
        b = f"blk.{i}."
        inv_freq, window = self.layer_geometry(i)
        return Layer(
            attn_norm=w.vector(b + "attn_norm.weight"),
            qkv=w.linear([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"], True),
            q_norm=w.vector(b + "attn_q_norm.weight"),
            k_norm=w.vector(b + "attn_k_norm.weight"),
            wo=w.linear([b + "attn_output.weight"], True),
            post_attn_norm=w.vector(b + "post_attention_norm.weight"),
            ffn_norm=w.vector(b + "ffn_norm.weight"),
            gate_up=w.linear([b + "ffn_gate.weight", b + "ffn_up.weight"], True),
            gate_up_pieces=w.gate_up_pieces(b + "ffn_gate.weight", b + "ffn_up.weight"),
            down=w.linear([b + "ffn_down.weight"], True),
            post_ffn_norm=w.vector(b + "post_ffw_norm.weight"),
            inv_freq=inv_freq,
            window=window,
        )

    # -- architecture hooks -------------------------------------------------------------

    def embedding_scale(self) -> float:
        return 1.0

    def layer_geometry(self, i: int) -> tuple[np.ndarray, int]:
        """Layer i's RoPE inverse frequencies and sliding window (0: full attention)."""
        c = self.config
        return rope_inv_freq(
            c.rope_dim, c.rope_base, self.rope_freq_scale(), self.rope_factors()
        ), 0

    def rope_freq_scale(self) -> float:
        s = self.config.rope_scaling  # linear, the one scaling ModelConfig lets through
        return 1.0 if s is None else 1.0 / s["factor"]

    def rope_factors(self) -> np.ndarray | None:
        # llama3-style scaling ships per-frequency divisors as the rope_freqs tensor
        return self.freq_factors if self.freq_factors.size else None

    # -- forward --------------------------------------------------------------------------

    def forward(self, batch: Batch, k_cache: list, v_cache: list):
        """batch of n tokens -> float32[m, vocab] logits of batch.logit_rows (all n if None).

        k_cache[i], v_cache[i]: layer i's block pools (see kernels.attention; None for the
        layers of a ggml span, whose cache is on its backend); the batch's K/V are written into
        its slots. The span's executor takes the residual stream before its first layer and
        returns the residual after its last, or the logits when it holds the head.
        """
        n = len(self.layers)
        x = kernels.embedding(self.tok_embd, batch.token_ids)  # [n, d] residual stream
        scale = self.embedding_scale()
        if scale != 1.0:
            x *= np.float32(scale)
        span = self.offload
        first, stop = (span.first, span.stop) if span else (n, n)
        x, h = self._host_layers(batch, x, 0, first, k_cache, v_cache)
        if span:
            x = self.executor(x, batch)
            if span.head:
                return self._softcap(x)
            if stop == n and batch.logit_rows is not None:  # the head needs only these rows
                x = x[batch.logit_rows]
            x, h = self._host_layers(batch, x, stop, n, k_cache, v_cache)
        return self._softcap(self.output(h, batch.row_wise))

    def _gated(self, L: Layer, h: np.ndarray, row_wise: bool | str) -> np.ndarray:
        """act(gate) * up of h: [n, n_ff]; a prompt step computes it range by range of the FFN's
        columns (edgeinfer.config.FFN_PIECE_COLS), so that one range's gate and up exist at a
        time. Each output column is its own weight row's dot product: the same bits either way."""
        if len(h) < FFN_PIECES_FROM or not L.gate_up_pieces:
            return gated_act(L.gate_up(h, row_wise), self.activation)
        out = np.empty((len(h), self.config.n_ff), np.float32)
        for at, piece in L.gate_up_pieces:
            gated_act(piece(h, row_wise), self.activation, out, at)
        return out

    def _softcap(self, logits: np.ndarray) -> np.ndarray:
        if self.config.final_logit_softcap:
            softcap_(logits, self.config.final_logit_softcap)
        return logits

    def _norm_before(self, i: int) -> np.ndarray:
        """The norm applied to the residual before layer i (the output norm after the last).
        Before a span's layer the normed stream is not used; the output norm stands in."""
        if i == len(self.layers) or self.layers[i] is None:
            return self.output_norm
        return self.layers[i].attn_norm

    def _host_layers(self, batch: Batch, x, lo: int, hi: int, k_cache: list, v_cache: list):
        """Layers lo .. hi-1 on edgeinfer's kernels -> (residual, its norm for what follows)."""
        c = self.config
        eps = c.norm_eps
        h = rms_norm(x, self._norm_before(lo), eps)
        last = len(self.layers) - 1
        row_wise = batch.row_wise
        for i in range(lo, hi):
            L = self.layers[i]
            tables, slots = batch.block_tables, batch.slots
            if L.window and batch.window_slots is not None:
                tables, slots = batch.window_block_tables, batch.window_slots
            attn = self_attention(
                L.qkv(h, row_wise),
                L.q_norm,
                L.k_norm,
                eps,
                L.inv_freq,
                self.rope_neox,
                c.attn_scale,
                L.window,
                k_cache[i],
                v_cache[i],
                tables,
                batch.seq_rows,
                batch.positions,
                slots,
                c.n_heads,
            )
            o = L.wo(attn, row_wise)
            if i == last and batch.logit_rows is not None:
                if len(batch.logit_rows) < len(x):  # (a decode step wants every row)
                    # Only the rows whose logits are wanted need the last FFN and the head.
                    x, o = x[batch.logit_rows], o[batch.logit_rows]
            h = add_rms_norm(x, o, L.post_attn_norm, L.ffn_norm, eps)
            del attn, o  # a prompt step's FFN is its peak of memory
            f = L.down(self._gated(L, h, row_wise), row_wise)
            h = add_rms_norm(x, f, L.post_ffn_norm, self._norm_before(i + 1), eps)
        return x, h
