"""Shape-checked graph building: every ggml op edgeinfer uses, with its preconditions checked in
Python first. A failed GGML_ASSERT aborts the whole process (a served model, every open
request), so a wrong shape must stop here as a GGMLError instead.

Shapes are ggml's: ne = (ne0, ne1, ne2, ne3), ne0 the contiguous dimension, so a numpy array of
shape (n, d) is ne (d, n).
"""

from __future__ import annotations

import ctypes as C
from dataclasses import dataclass

from edgeinfer.gguf.constants import GGMLQuantizationType as T

from .lib import CGraph, GGMLError, InitParams, load, tensor

F32, F16, I32, I64 = T.F32, T.F16, T.I32, T.I64


@dataclass(frozen=True)
class Node:
    """A tensor of the graph being built: its pointer, shape and type as ggml has them."""

    ptr: int
    ne: tuple[int, int, int, int]
    type: T

    @property
    def n(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]


def _ne(*dims: int) -> tuple[int, int, int, int]:
    return (*dims, *(1,) * (4 - len(dims)))  # type: ignore[return-value]


class Builder:
    """One ggml context of tensor metadata (no_alloc: data lives in backend buffers)."""

    def __init__(self, max_tensors: int, graph_size: int = 0):
        self.lib = load()
        size = max_tensors * self.lib.ggml_tensor_overhead()
        if graph_size:
            size += self.lib.ggml_graph_overhead_custom(graph_size, False)
        self.graph_size = graph_size
        self.ctx = self.lib.ggml_init(InitParams(size, None, True))
        if not self.ctx:
            raise GGMLError("ggml_init failed (out of memory)")

    def free(self) -> None:
        if self.ctx:
            self.lib.ggml_free(self.ctx)
            self.ctx = None

    def _wrap(self, ptr: int | None, ne: tuple, typ: T) -> Node:
        if not ptr:
            raise GGMLError("ggml returned no tensor (the context is full)")
        got = tuple(tensor(ptr).ne)
        if got != ne:  # the bindings' idea of an op's shape and ggml's disagree: an ABI drift
            raise GGMLError(f"ggml made a tensor of shape {got}, expected {ne}")
        return Node(ptr, ne, typ)

    @staticmethod
    def _need(ok: bool, what: str) -> None:
        if not ok:
            raise GGMLError(f"invalid graph: {what}")

    # -- leaves ---------------------------------------------------------------------------

    def new(self, typ: T, *dims: int, name: str = "", input: bool = False) -> Node:
        self._need(1 <= len(dims) <= 3 and all(d >= 1 for d in dims), f"tensor dims {dims}")
        fn = getattr(self.lib, f"ggml_new_tensor_{len(dims)}d")
        ptr = fn(self.ctx, int(typ), *dims)
        node = self._wrap(ptr, _ne(*dims), typ)
        if name:
            self.lib.ggml_set_name(ptr, name.encode())
        if input:
            self.lib.ggml_set_input(ptr)
        return node

    # -- views ----------------------------------------------------------------------------

    def reshape(self, a: Node, *dims: int) -> Node:
        self._need(len(dims) in (2, 3), f"reshape to {dims}")
        ne = _ne(*dims)
        self._need(a.n == ne[0] * ne[1] * ne[2], f"reshape {a.ne} to {dims}")
        fn = getattr(self.lib, f"ggml_reshape_{len(dims)}d")
        return self._wrap(fn(self.ctx, a.ptr, *dims), ne, a.type)

    def rows_view(self, a: Node, ne0: int, ne1: int, ne2: int) -> Node:
        """a: [ne0 * ne1, rows] -> [ne0, ne1, ne2] over its first ne2 rows (a cache's first
        ne2 slots, seen per head)."""
        self._need(a.ne[0] == ne0 * ne1 and ne2 <= a.ne[1], f"view {(ne0, ne1, ne2)} of {a.ne}")
        size = self.lib.ggml_type_size(int(a.type))
        nb1, nb2 = ne0 * size, ne0 * ne1 * size
        ptr = self.lib.ggml_view_4d(self.ctx, a.ptr, ne0, ne1, ne2, 1, nb1, nb2, nb2 * ne2, 0)
        return self._wrap(ptr, _ne(ne0, ne1, ne2), a.type)

    def permute_0213(self, a: Node) -> Node:
        ptr = self.lib.ggml_permute(self.ctx, a.ptr, 0, 2, 1, 3)
        return self._wrap(ptr, (a.ne[0], a.ne[2], a.ne[1], a.ne[3]), a.type)

    # -- ops ------------------------------------------------------------------------------

    def mul_mat(self, w: Node, x: Node) -> Node:
        # w: [k, m], x: [k, n] -> [m, n]
        self._need(w.ne[0] == x.ne[0] and w.ne[2:] == (1, 1), f"mul_mat {w.ne} x {x.ne}")
        return self._wrap(self.lib.ggml_mul_mat(self.ctx, w.ptr, x.ptr), (w.ne[1], *x.ne[1:]), F32)

    def _broadcast(self, fn, a: Node, b: Node) -> Node:
        ok = all(bd >= 1 and ad % bd == 0 for ad, bd in zip(a.ne, b.ne, strict=True))
        self._need(ok and b.type == F32, f"broadcast {b.ne} onto {a.ne}")
        return self._wrap(fn(self.ctx, a.ptr, b.ptr), a.ne, a.type)

    def add(self, a: Node, b: Node) -> Node:
        return self._broadcast(self.lib.ggml_add, a, b)

    def mul(self, a: Node, b: Node) -> Node:
        return self._broadcast(self.lib.ggml_mul, a, b)

    def rms_norm(self, a: Node, eps: float) -> Node:
        self._need(a.type == F32, "rms_norm of a non-f32 tensor")
        return self._wrap(self.lib.ggml_rms_norm(self.ctx, a.ptr, eps), a.ne, F32)

    def rope(self, a: Node, pos: Node, factors: Node, n_dims: int, mode: int) -> Node:
        # a: [head_dim, heads, n], pos: int32[n], factors: f32[n_dims / 2] -> a's shape
        self._need(
            pos.type == I32 and pos.ne[0] == a.ne[2] and n_dims % 2 == 0 and n_dims <= a.ne[0],
            f"rope of {a.ne} at {pos.ne}, {n_dims} dims",
        )
        self._need(factors.ne[0] >= n_dims // 2, f"rope factors {factors.ne}")
        # freq_base 10000 and freq_scale 1: every frequency comes from `factors` (see layers)
        ptr = self.lib.ggml_rope_ext(
            self.ctx,
            a.ptr,
            pos.ptr,
            factors.ptr,
            n_dims,
            mode,
            0,
            10000.0,
            1.0,
            0.0,
            1.0,
            32.0,
            1.0,
        )
        return self._wrap(ptr, a.ne, F32)

    def set_rows(self, dst: Node, src: Node, idx: Node) -> Node:
        # dst: [w, rows], src: [w, n], idx: int64[n] -> a view of dst with src's rows written
        self._need(
            dst.ne[0] == src.ne[0] and idx.type == I64 and idx.ne[0] == src.ne[1],
            f"set_rows {src.ne} into {dst.ne} at {idx.ne}",
        )
        ptr = self.lib.ggml_set_rows(self.ctx, dst.ptr, src.ptr, idx.ptr)
        return self._wrap(ptr, dst.ne, dst.type)

    def get_rows(self, a: Node, idx: Node) -> Node:
        # a: [w, rows], idx: int32[m] -> [w, m]
        self._need(a.ne[2:] == (1, 1) and idx.type == I32, f"get_rows {idx.ne} of {a.ne}")
        ptr = self.lib.ggml_get_rows(self.ctx, a.ptr, idx.ptr)
        return self._wrap(ptr, _ne(a.ne[0], idx.ne[0]), F32)

    def flash_attn(self, q: Node, k: Node, v: Node, mask: Node, scale: float) -> Node:
        # q: [dk, n, heads], k: [dk, nkv, kv_heads], v: [dv, nkv, kv_heads], mask: f16[nkv, n]
        # -> [dv, heads, n]
        self._need(
            q.ne[0] == k.ne[0]
            and k.ne[1] == v.ne[1]
            and k.ne[2] == v.ne[2]
            and q.ne[2] % k.ne[2] == 0
            and mask.type == F16
            and mask.ne[0] == k.ne[1]
            and mask.ne[1] >= q.ne[1]
            and q.ne[3] == k.ne[3] == v.ne[3] == 1,
            f"flash_attn q {q.ne} k {k.ne} v {v.ne} mask {mask.ne}",
        )
        ptr = self.lib.ggml_flash_attn_ext(self.ctx, q.ptr, k.ptr, v.ptr, mask.ptr, scale, 0, 0)
        return self._wrap(ptr, (v.ne[0], q.ne[2], q.ne[1], 1), F32)

    def glu(self, gate: Node, up: Node, gelu: bool) -> Node:
        """act(gate) * up: SwiGLU, or GeGLU with the tanh GELU."""
        self._need(gate.ne == up.ne, f"glu {gate.ne} and {up.ne}")
        fn = self.lib.ggml_geglu_split if gelu else self.lib.ggml_swiglu_split
        return self._wrap(fn(self.ctx, gate.ptr, up.ptr), gate.ne, F32)

    # -- graph ----------------------------------------------------------------------------

    def graph(self, outputs: list[Node]) -> int:
        self._need(self.graph_size > 0, "a context made without room for a graph")
        gf = self.lib.ggml_new_graph_custom(self.ctx, self.graph_size, False)
        for out in outputs:
            self.lib.ggml_set_output(out.ptr)
            self.lib.ggml_build_forward_expand(gf, out.ptr)
        self._name_graph(gf)
        return gf

    def _name_graph(self, gf: int) -> None:
        """Give the graph a uid, as ggml's scheduler does for llama.cpp: the RPC backend then
        sends a graph computed twice in a row once, and a 4-byte request after (the layout is
        checked against ggml's own accessors first; unchecked, the graph goes without)."""
        g = CGraph.from_address(gf)
        n = self.lib.ggml_graph_n_nodes(gf)
        if (
            (g.size, g.n_nodes, g.uid) == (self.graph_size, n, 0)
            and n
            and all(g.nodes[i] == self.lib.ggml_graph_node(gf, i) for i in (0, n - 1))
        ):
            g.uid = self.lib.ggml_graph_next_uid()

    def graph_nodes(self, gf: int) -> list[int]:
        return [self.lib.ggml_graph_node(gf, i) for i in range(self.lib.ggml_graph_n_nodes(gf))]


def node_name(ptr: int) -> str:
    t = tensor(ptr)
    return t.name.decode(errors="replace") or f"op {t.op}"


def c_ptr(ptr: int) -> C.c_void_p:
    return C.c_void_p(ptr)
