"""The span's weights on its backend, uploaded once and never requantized.

Matrices go as the GGUF file stores them (any of the types edgeinfer supports: ggml reads the
same blocks). On a device that computes in host RAM (the CPU backend) they are not copied at
all: a buffer wraps the memory-mapped file and each tensor points at its bytes, so they stay
mapped. Vectors (norms, biases, RoPE frequency factors) go as float32, as edgeinfer's own loader
reads them, so f16 norms work the same on both paths.
"""

from __future__ import annotations

import numpy as np

from .backends import Backend
from .graph import F32, Builder, Node
from .lib import BUFFER_USAGE_WEIGHTS, GGMLError

TENSOR_ALIGNMENT = 32  # ggml's, for data a buffer does not allocate itself


class Weights:
    """Named tensors on `backend`; `matrix()` / `vector()` declare them, `upload()` places them."""

    def __init__(self, backend: Backend, max_tensors: int):
        self.backend = backend
        self.ctx = Builder(max_tensors)
        self.vec_ctx = Builder(max_tensors)
        self.lib = self.ctx.lib
        self._mats: list[tuple[Node, np.ndarray]] = []  # the views keep the mapping alive
        self._vecs: list[tuple[Node, np.ndarray]] = []
        self.buffers: list[int] = []
        self.device_bytes = 0  # bytes allocated on the device (0 for mapped matrices)

    def matrix(self, raw: np.ndarray, qtype, shape: tuple[int, ...]) -> Node:
        """raw: the file's bytes of a [out, in] weight -> ggml [in, out]."""
        out, inp = shape
        node = self.ctx.new(qtype, inp, out)
        if self.lib.ggml_nbytes(node.ptr) != raw.nbytes:
            raise GGMLError(f"a {qtype.name} [{out}, {inp}] weight is not {raw.nbytes} bytes")
        self._mats.append((node, raw))
        return node

    def vector(self, values: np.ndarray) -> Node:
        v = np.ascontiguousarray(values, np.float32).reshape(-1)
        node = self.vec_ctx.new(F32, len(v))
        self._vecs.append((node, v))
        return node

    def upload(self) -> None:
        """Place every declared tensor: matrices wrapped in place on a host device (when their
        bytes are aligned as ggml needs), else copied to the device."""
        lib = self.lib
        copied = []
        for node, raw in self._mats:
            if self.backend.is_host and raw.ctypes.data % TENSOR_ALIGNMENT == 0:
                buf = lib.ggml_backend_cpu_buffer_from_ptr(raw.ctypes.data, raw.nbytes)
                self._own(buf, "mapped weights")
                lib.ggml_backend_buffer_set_usage(buf, BUFFER_USAGE_WEIGHTS)
                lib.ggml_backend_tensor_alloc(buf, node.ptr, raw.ctypes.data)
            else:
                copied.append((node, raw))
        if copied:
            # the context holds every matrix; the mapped ones already have their data
            buf = lib.ggml_backend_alloc_ctx_tensors(self.ctx.ctx, self.backend.ptr)
            self._own(buf, "weights")
            lib.ggml_backend_buffer_set_usage(buf, BUFFER_USAGE_WEIGHTS)
            self.device_bytes += lib.ggml_backend_buffer_get_size(buf)
            for node, raw in copied:
                lib.ggml_backend_tensor_set(node.ptr, raw.ctypes.data, 0, raw.nbytes)
        if self._vecs:
            buf = lib.ggml_backend_alloc_ctx_tensors(self.vec_ctx.ctx, self.backend.ptr)
            self._own(buf, "norm weights")
            self.device_bytes += lib.ggml_backend_buffer_get_size(buf)
            for node, v in self._vecs:
                lib.ggml_backend_tensor_set(node.ptr, v.ctypes.data, 0, v.nbytes)
        self._vecs = []  # (the matrices' views stay: mapped tensors point into them)

    def _own(self, buf: int, what: str) -> None:
        if not buf:
            raise GGMLError(f"ggml {self.backend.name}: could not allocate the {what}")
        self.buffers.append(buf)

    def close(self) -> None:
        for buf in self.buffers:
            self.lib.ggml_backend_buffer_free(buf)
        self.buffers = []
        self.ctx.free()
        self.vec_ctx.free()
        self._mats = []
