"""Weight-level error between two GGUF files of one model (e.g. Q4_K_M against its F16 source),
and the bits per weight of a file.

NMSE = Σ(a - b)² / Σb² per tensor, b the reference; max error = max |a - b|. Tensors are
dequantized (bit-exact with gguf.quants) a slab of rows at a time, so memory stays bounded
whatever the vocabulary.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.reader import GGUFFile, read_gguf

SLAB_ELEMENTS = 1 << 22  # dequantize this many weights at a time (16 MB of float32)


def bits_per_weight(g: GGUFFile) -> float:
    """Tensor data bits over tensor elements (metadata and padding not counted)."""
    n = sum(t.n_elements for t in g.tensors.values())
    return 8 * sum(t.nbytes for t in g.tensors.values()) / n if n else 0.0


def type_counts(g: GGUFFile) -> dict[str, int]:
    """Tensor type name -> number of tensors of it, most common first."""
    return dict(Counter(t.qtype.name for t in g.tensors.values()).most_common())


def describe(g: GGUFFile) -> str:
    """One line: the file's types and bits per weight, e.g. 'Q4_K x 96, Q6_K x 12, F32 x 61;
    4.85 bits per weight'."""
    types = ", ".join(f"{name} x {n}" for name, n in type_counts(g).items())
    return f"{types}; {bits_per_weight(g):.2f} bits per weight"


@dataclass(frozen=True)
class TensorError:
    name: str
    shape: tuple[int, ...]
    type_a: str
    type_b: str
    nmse: float
    max_error: float

    def as_dict(self) -> dict:
        return {**self.__dict__, "shape": list(self.shape)}


def _slabs(g: GGUFFile, name: str):
    """float64 slabs of rows of tensor `name`, in order."""
    from edgeinfer import kernels

    info = g.tensors[name]
    data = g.tensor_data(name)
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    cols = info.shape[-1]
    row_bytes = info.nbytes // rows
    step = max(1, SLAB_ELEMENTS // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        raw = data[r * row_bytes : (r + n) * row_bytes]
        yield kernels.dequantize(raw, info.qtype, (n, cols)).astype(np.float64)


def tensor_error(a: GGUFFile, b: GGUFFile, name: str) -> TensorError:
    ta, tb = a.tensors[name], b.tensors[name]
    sq_err = sq_ref = 0.0
    max_err = 0.0
    for xa, xb in zip(_slabs(a, name), _slabs(b, name), strict=True):
        d = xa - xb
        sq_err += float(np.dot(d.ravel(), d.ravel()))
        sq_ref += float(np.dot(xb.ravel(), xb.ravel()))
        max_err = max(max_err, float(np.abs(d).max()))
    nmse = sq_err / sq_ref if sq_ref else (0.0 if sq_err == 0 else float("inf"))
    return TensorError(name, ta.shape, ta.qtype.name, tb.qtype.name, nmse, max_err)


def compare(path_a: str | os.PathLike, path_b: str | os.PathLike, progress=None):
    """Every tensor of A against the same tensor of B (the reference) -> (errors sorted by
    NMSE, worst first, the two GGUFFiles). Raises EdgeInferError unless both files hold the
    same tensor names and shapes."""
    a, b = read_gguf(path_a), read_gguf(path_b)
    only_a = a.tensors.keys() - b.tensors.keys()
    only_b = b.tensors.keys() - a.tensors.keys()
    if only_a or only_b:
        name, where = (min(only_a), a.path) if only_a else (min(only_b), b.path)
        raise EdgeInferError(
            f"not the same model: tensor {name} is only in {where} "
            f"({len(only_a) + len(only_b)} tensors differ)"
        )
    for name, info in a.tensors.items():
        if info.shape != b.tensors[name].shape:
            raise EdgeInferError(
                f"not the same model: tensor {name} is {list(info.shape)} in {a.path}, "
                f"{list(b.tensors[name].shape)} in {b.path}"
            )
    errors = []
    for i, name in enumerate(a.tensors):
        errors.append(tensor_error(a, b, name))
        if progress is not None:
            progress(i + 1, len(a.tensors), name)
    errors.sort(key=lambda e: (-e.nmse, e.name))
    return errors, a, b


def total_nmse(errors: list[TensorError], a: GGUFFile) -> float:
    """Element-weighted mean of the tensors' NMSE (each tensor's share of the weights)."""
    n = {e.name: a.tensors[e.name].n_elements for e in errors}
    total = sum(n.values())
    return sum(e.nmse * n[e.name] for e in errors) / total if total else 0.0
