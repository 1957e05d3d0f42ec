"""SpanExecutor: a contiguous span of a model's layers (and optionally its output norm and head)
computed by a ggml backend, one graph per step, inside edgeinfer's engine.

The model hands it the residual stream before the span's first layer and gets back the
residual after its last (or the logits, when the head is in the span). Graphs are cached by
(padded token count, visible cache rows, padded logit rows); every input of a graph is set
before each compute (ggml's allocator reuses an input's memory once its consumers have run).
One allocator serves every graph: it is reserved for the largest step at load, so that step's
compute buffer is counted before anything runs and later graphs never grow it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edgeinfer.units import human_bytes

from .backends import Backend, open_backend
from .graph import F16, F32, I32, I64, Builder, Node, node_name
from .kv import DeviceKV, attention_mask, bucket_rows, causal_mask, device_rows, sequence_rows
from .layers import MATRICES, VECTORS, Facts, LayerNodes, block, head, rope_factors
from .lib import STATUS_SUCCESS, GGMLError, tensor
from .placement import Span
from .weights import Weights

NODES_PER_LAYER = 48  # graph nodes one layer makes, with room (checked when a graph is built)
MAX_GRAPHS = 48  # cached graphs; the least recently used is dropped beyond this


def bucket_tokens(n: int) -> int:
    """Padded token count of a graph: exact up to 16 (decode batches), then multiples of 64."""
    return n if n <= 16 else -(-n // 64) * 64


@dataclass
class _Graph:
    builder: Builder
    gf: int
    inputs: dict[str, Node]
    out: Node


class SpanExecutor:
    """Layers span.first .. span.stop - 1 of `model` on ggml backend span.backend."""

    def __init__(
        self,
        model,
        gguf,
        span: Span,
        num_blocks: int,
        block_size: int,
        kv_dtype: str,
        max_tokens: int,
        max_logit_rows: int,
        threads: int,
    ):
        self.span = span
        self.model = model
        self.facts = Facts.of(model)
        self.block_size = block_size
        self.backend: Backend = open_backend(span.backend)
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._allocated: tuple | None = None
        self.token_by_token = False  # batch-invariant mode (see _one_by_one)
        self.galloc = 0
        self.weights: Weights | None = None
        self.kv: DeviceKV | None = None
        try:
            self.backend.set_threads(threads)
            self._check_memory(gguf, num_blocks, kv_dtype, max_tokens, max_logit_rows)
            self._load(gguf, model)
            self.kv = DeviceKV(
                self.backend,
                span.stop - span.first,
                self.facts.n_kv_heads * self.facts.head_dim,
                self.facts.n_kv_heads * self.facts.v_head_dim,
                num_blocks,
                block_size,
                kv_dtype,
            )
            lib = self.backend_lib = self.weights.lib
            self.galloc = lib.ggml_gallocr_new(
                lib.ggml_backend_get_default_buffer_type(self.backend.ptr)
            )
            # the largest step: every token, every row of the cache, a logit row per sequence
            largest = self._graph(
                bucket_tokens(max_tokens), self.kv.rows, bucket_tokens(max_logit_rows)
            )
            if not lib.ggml_gallocr_reserve(self.galloc, largest.gf):
                raise GGMLError(f"ggml {span.backend}: could not allocate the compute buffer")
            self.compute_bytes = lib.ggml_gallocr_get_buffer_size(self.galloc, 0)
        except BaseException:
            self.close()
            raise

    # -- loading --------------------------------------------------------------------------

    def _check_memory(self, gguf, num_blocks, kv_dtype, max_tokens, max_logit_rows) -> None:
        """Refuse a span whose weights, KV cache and step buffers exceed the device's free
        memory, before allocating any of them."""
        need = self.planned_bytes(gguf, self.model.config, self.span, num_blocks, kv_dtype,
                                  max_tokens, max_logit_rows, self.backend.is_host)  # fmt: skip
        free, _ = self.backend.memory()
        total = sum(need.values())
        if total > free:
            parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in need.items())
            raise GGMLError(
                f"{self.span.describe()} needs {human_bytes(total)} ({parts}), but "
                f"{self.backend.describe()} has {human_bytes(free)} free; offload fewer layers "
                "or use a smaller --ctx, --parallel or --kv-budget"
            )

    @staticmethod
    def planned_bytes(gguf, cfg, span: Span, num_blocks, kv_dtype, max_tokens, max_logit_rows,
                      host: bool) -> dict[str, int]:  # fmt: skip
        """Device memory of a span: weights (0 when a host device maps them), KV cache, and an
        estimate of a step's buffers (one layer's activations, as edgeinfer's own plan counts
        them, plus the mask and the logits)."""
        from edgeinfer.engine.kv_cache import BLOCK_SIZE
        from edgeinfer.engine.memory_plan import step_bytes

        n = span.stop - span.first
        weights = 0
        if not host:
            names = [
                f"blk.{i}.{s}" for i in range(span.first, span.stop) for s in MATRICES.values()
            ]
            if span.head:
                names.append("output.weight" if not cfg.tied_output else "token_embd.weight")
            weights = sum(gguf.tensors[nm].nbytes for nm in names)
        dims = cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim)
        kv = DeviceKV.bytes_needed(n, dims, num_blocks, BLOCK_SIZE, kv_dtype)
        rows = kv // max(1, n * dims * (2 if kv_dtype == "f16" else 4))
        logits = max_logit_rows if span.head else 0
        step = step_bytes(cfg, max_tokens, logits) + 2 * max_tokens * rows * 2
        return {"weights": weights, "KV cache": kv, "compute": step}

    def _load(self, gguf, model) -> None:
        from edgeinfer.models.base import WeightLoader

        span, f = self.span, self.facts
        loader = WeightLoader(gguf, model.config)
        n = span.stop - span.first
        w = self.weights = Weights(self.backend, (len(MATRICES) + len(VECTORS) + 1) * n + 4)
        factors: dict[bytes, Node] = {}
        self.layers: list[LayerNodes] = []
        for i in range(span.first, span.stop):
            b = f"blk.{i}."
            mats = {}
            for role, suffix in MATRICES.items():
                info = loader.info(b + suffix)
                mats[role] = w.matrix(gguf.tensor_data(info.name), info.qtype, info.shape)
            vecs = {
                role: w.vector(loader.vector(b + suffix)) if loader.has(b + suffix) else None
                for role, suffix in VECTORS.items()
            }
            inv_freq, window = model.layer_geometry(i)
            ff = rope_factors(inv_freq, f.rope_dim)
            if ff.tobytes() not in factors:
                factors[ff.tobytes()] = w.vector(ff)
            self.layers.append(LayerNodes(mats, vecs, factors[ff.tobytes()], window))
        self.head = None
        if span.head:
            name = "token_embd.weight" if model.config.tied_output else "output.weight"
            info = loader.info(name)
            out = w.matrix(gguf.tensor_data(name), info.qtype, info.shape)
            bias = w.vector(loader.vector("output.bias")) if loader.has("output.bias") else None
            self.head = (w.vector(loader.vector("output_norm.weight")), out, bias)
        w.upload()
        self.windows = sorted({L.window for L in self.layers})
        if len([w for w in self.windows if w]) > 1:  # one sliding mask per step
            raise GGMLError(f"layers with different sliding windows {self.windows}")

    # -- graphs ---------------------------------------------------------------------------

    def _graph(self, n_pad: int, n_rows: int, m_pad: int, gather: bool = False) -> _Graph:
        key = (n_pad, n_rows, m_pad, gather)
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        f, cfg = self.facts, self.model.config
        n_layers = len(self.layers)
        size = NODES_PER_LAYER * n_layers + 64
        b = Builder(size, graph_size=size)
        try:
            io = {
                "x": b.new(F32, cfg.n_embd, n_pad, name="x", input=True),
                "pos": b.new(I32, n_pad, name="pos", input=True),
                "rows": b.new(I64, n_pad, name="kv_rows", input=True),
                "n_rows": n_rows,
            }
            if gather:
                io["kv_idx"] = b.new(I32, n_rows, name="kv_idx", input=True)
            # a mask no layer reads would be left out of the graph, and have no memory
            if 0 in self.windows:
                io["mask"] = b.new(F16, n_rows, n_pad, name="mask", input=True)
            if any(self.windows):
                io["mask_swa"] = b.new(F16, n_rows, n_pad, name="mask_swa", input=True)
            with_head = self.head is not None and m_pad > 0
            keep = b.new(I32, m_pad, name="out_rows", input=True) if with_head else None
            if keep is not None:
                io["out_rows"] = keep
            x = io["x"]
            for j, L in enumerate(self.layers):
                last = keep if j == n_layers - 1 else None
                x = block(b, L, f, x, io, self.kv.k[j], self.kv.v[j], last)
            if with_head:
                norm, w, bias = self.head
                x = head(b, norm, w, bias, x, f.eps)
            gf = b.graph([x])
            self._check_supported(b, gf)
            self._alloc(key, gf)
            for name, node in io.items():
                if isinstance(node, Node) and not tensor(node.ptr).buffer:
                    raise GGMLError(f"ggml graph input {name} is not part of the graph")
        except BaseException:
            b.free()
            raise
        inputs = {k: v for k, v in io.items() if isinstance(v, Node)}
        g = self._graphs[key] = _Graph(b, gf, inputs, x)
        if len(self._graphs) > MAX_GRAPHS:
            _, old = self._graphs.popitem(last=False)
            old.builder.free()
        return g

    def _alloc(self, key: tuple, gf: int) -> None:
        """Point the graph's tensors into the compute buffer (again after another graph)."""
        if self._allocated != key:
            if not self.backend_lib.ggml_gallocr_alloc_graph(self.galloc, gf):
                raise GGMLError(f"ggml {self.span.backend}: could not allocate a step's buffers")
            self._allocated = key

    def make_batch_invariant(self) -> None:
        """Give each token the same bits whatever it is batched with: ggml's reference kernels
        and a graph per token (see _one_by_one). Only ggml's CPU backend has such kernels."""
        if not self.backend.set_reference(True):
            self.close()
            raise GGMLError(
                f"batch-invariant mode cannot run layers on ggml {self.span.backend}: only ggml's "
                "CPU backend guarantees the same bits whatever the batch (use --offload ...@cpu, "
                "or leave batch invariance off)"
            )
        self.token_by_token = True

    def _check_supported(self, b: Builder, gf: int) -> None:
        lib = b.lib
        for node in b.graph_nodes(gf):
            if not lib.ggml_backend_supports_op(self.backend.ptr, node):
                raise GGMLError(
                    f"ggml backend {self.span.backend} cannot run {node_name(node)} of this model"
                )

    # -- a step ---------------------------------------------------------------------------

    def __call__(self, x: np.ndarray, batch) -> np.ndarray:
        """x: float32[n, d], the residual before the span -> float32[n, d] after it, or with
        the head float32[m, vocab] logits of batch.logit_rows (all n if None)."""
        if self.token_by_token and len(x) > 1:
            return self._one_by_one(x, batch)
        return self._step(x, batch)

    def _one_by_one(self, x: np.ndarray, batch) -> np.ndarray:
        """Batch-invariant mode: a graph per token, so each token's arithmetic is the same
        whatever it is batched with (ggml's kernels choose their loops by the batch size)."""
        from edgeinfer.models.base import Batch

        wanted = set(range(len(x)) if batch.logit_rows is None else batch.logit_rows.tolist())
        one, none = np.zeros(1, np.int64), np.zeros(0, np.int64)
        outs = []
        for t in range(len(x)):
            s = batch.seq_rows[t]
            token = Batch(
                token_ids=batch.token_ids[t : t + 1],
                positions=batch.positions[t : t + 1],
                seq_rows=np.zeros(1, np.int32),
                slots=batch.slots[t : t + 1],
                block_tables=batch.block_tables[s : s + 1],
                logit_rows=one if t in wanted else none,
            )
            outs.append(self._step(x[t : t + 1], token))
        return np.concatenate(outs)

    def _step(self, x: np.ndarray, batch) -> np.ndarray:
        n, d = x.shape
        n_pad = bucket_tokens(n)
        gather = self.token_by_token
        if gather:  # one token; its sequence's rows in order
            order = sequence_rows(batch.positions[0], batch.block_tables[0], self.block_size)
            rows = bucket_rows(len(order), self.kv.rows)
        else:
            rows = self.kv.view_rows(batch.block_tables)
        out_rows = batch.logit_rows if batch.logit_rows is not None else np.arange(n)
        m = len(out_rows) if self.head else 0
        key = (n_pad, rows, bucket_tokens(m) if m else 0, gather)  # no logits wanted: no head
        g = self._graph(*key)
        self._alloc(key, g.gf)
        lib = self.backend_lib
        xin = np.zeros((n_pad, d), np.float32)
        xin[:n] = x
        pos = np.zeros(n_pad, np.int32)
        pos[:n] = batch.positions
        feed = {"x": xin, "pos": pos, "rows": device_rows(batch.slots, n_pad)}
        for name, window in (("mask", 0), ("mask_swa", max(self.windows))):
            if name not in g.inputs:
                continue
            if gather:
                feed[name] = causal_mask(int(batch.positions[0]), rows, window)
            else:
                feed[name] = attention_mask(
                    batch.positions, batch.seq_rows, batch.block_tables, self.block_size,
                    n_pad, rows, window,
                )  # fmt: skip
        if gather:
            idx = np.zeros(rows, np.int32)
            idx[: len(order)] = order
            feed["kv_idx"] = idx
        if m:
            keep = np.zeros(g.inputs["out_rows"].ne[0], np.int32)
            keep[:m] = out_rows
            feed["out_rows"] = keep
        for name, node in g.inputs.items():
            arr = feed[name]
            lib.ggml_backend_tensor_set(node.ptr, arr.ctypes.data, 0, arr.nbytes)
        status = lib.ggml_backend_graph_compute(self.backend.ptr, g.gf)
        if status != STATUS_SUCCESS:
            raise GGMLError(f"ggml {self.span.backend}: compute failed (status {status})")
        if self.head and not m:
            return np.empty((0, self.model.config.vocab_size), np.float32)
        out = np.empty((g.out.ne[1], g.out.ne[0]), np.float32)
        lib.ggml_backend_tensor_get(g.out.ptr, out.ctypes.data, 0, out.nbytes)
        return out[:m] if self.head else out[:n]

    # -- reports --------------------------------------------------------------------------

    @property
    def device_bytes(self) -> dict[str, int]:
        return {
            "weights": self.weights.device_bytes if self.weights else 0,
            "KV cache": self.kv.nbytes if self.kv else 0,
            "compute": getattr(self, "compute_bytes", 0),
        }

    def report(self) -> str:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in self.device_bytes.items())
        mapped = " (weights mapped from the file)" if self.backend.is_host else ""
        return f"{self.span.describe()}: {self.backend.describe()}, {parts}{mapped}"

    def __del__(self):  # a dropped model gives its device memory back
        try:
            self.close()
        except Exception:  # interpreter shutdown: ggml may already be unloaded
            pass

    def close(self) -> None:
        for g in self._graphs.values():
            g.builder.free()
        self._graphs.clear()
        if self.galloc:
            self.backend_lib.ggml_gallocr_free(self.galloc)
            self.galloc = 0
        if self.kv is not None:
            self.kv.close()
        if self.weights is not None:
            self.weights.close()
        self.backend.close()
