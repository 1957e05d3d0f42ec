"""QuantWeight: a weight matrix that stays in its file's bytes (plus a small load-time repack)."""

from __future__ import annotations

import math

import numpy as np

from edgeinfer.gguf.constants import GGMLQuantizationType

from .block_matmul import parts_of
from .registry import QuantType, as_qtype, get_unit


def raw_rows(data: np.ndarray, unit: QuantType, shape) -> np.ndarray:
    """data: uint8 bytes of a tensor of `shape` (rows-first) -> uint8[rows, row_bytes] view."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0 or min(shape) < 1:
        raise ValueError(f"bad tensor shape {shape}")
    cols = shape[-1]
    if cols % unit.block_size:
        raise ValueError(
            f"{unit.qtype.name}: row length {cols} is not a multiple of {unit.block_size}"
        )
    rows = math.prod(shape[:-1])
    row_bytes = unit.row_bytes(cols)
    data = np.asarray(data)
    if data.dtype != np.uint8:
        data = data.reshape(-1).view(np.uint8)
    if data.size != rows * row_bytes:
        raise ValueError(
            f"{unit.qtype.name} tensor of shape {shape} needs {rows * row_bytes} bytes, "
            f"got {data.size}"
        )
    raw = np.ascontiguousarray(data.reshape(rows, row_bytes))
    if raw.flags.writeable:
        # Kernels are compiled for read-only bytes (what a read-only memmap gives); one
        # specialisation instead of two.
        raw = raw.view()
        raw.flags.writeable = False
    return raw


class QuantWeight:
    """A weight [out, in] in GGML type `qtype`; matmul/embedding read it without dequantizing it.

    raw: uint8[out, row_bytes], a view of the memory-mapped file; packed: the unit's load-time
    layout (views of raw plus at most ~10 % extra arrays); row_parts: raw as the row-tile
    kernel's (flat, starts, ends) (views plus 16 bytes).
    """

    __slots__ = ("shape", "qtype", "unit", "raw", "packed", "row_parts", "extra_nbytes")

    def __init__(self, raw: np.ndarray, unit: QuantType, shape: tuple[int, int]):
        self.shape = shape
        self.qtype: GGMLQuantizationType = unit.qtype
        self.unit = unit
        self.raw = raw
        self.packed = unit.repack(raw)
        self.row_parts = self.packed if unit.repack is parts_of else parts_of(raw)
        arrays = {id(a): a for a in (*self.packed, *self.row_parts)}.values()
        self.extra_nbytes = sum(a.nbytes for a in arrays if not np.may_share_memory(a, raw))

    @classmethod
    def from_raw(cls, data: np.ndarray, qtype, shape) -> QuantWeight:
        """data: the tensor's bytes as in the file; shape: (out, in) rows-first."""
        unit = get_unit(as_qtype(qtype))
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise ValueError(f"a weight must be 2-D (out, in), got shape {shape}")
        return cls(raw_rows(data, unit, shape), unit, shape)

    def rows(self, lo: int, hi: int) -> QuantWeight:
        """Rows lo .. hi-1 as a weight of their own (a view: no bytes copied)."""
        return QuantWeight(self.raw[lo:hi], self.unit, (hi - lo, self.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def __repr__(self) -> str:
        return (
            f"QuantWeight({self.qtype.name}, shape={self.shape}, nbytes={self.nbytes}, "
            f"extra_nbytes={self.extra_nbytes})"
        )


def _buffer(a: np.ndarray) -> np.ndarray:
    # the outermost array `a` is a view of (a model file's np.memmap for its tensors)
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def stack(parts: list[QuantWeight]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The packed (flat, starts, ends) that runs the fused small-n kernel once over `parts`
    (one output, their rows in order), or None: as `stack_rows`, or a unit without a
    block-matmul kernel. No copy."""
    if parts[0].unit.repack is not parts_of:  # the units whose small-n kernel is block_matmul
        return None
    return stack_rows(parts)


def stack_rows(parts: list[QuantWeight]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The (flat, starts, ends) that runs the row-tile kernel once over `parts`, or None: parts
    of different types or input sizes, or not in one buffer (a model file's are). No copy."""
    unit, cols = parts[0].unit, parts[0].shape[1]
    if len(parts) < 2 or any(p.unit is not unit or p.shape[1] != cols for p in parts):
        return None
    buf = _buffer(parts[0].raw)
    if any(_buffer(p.raw) is not buf for p in parts) or not buf.flags.c_contiguous:
        return None
    flat = buf.view(np.ndarray).reshape(-1).view(np.uint8)
    flat.flags.writeable = False  # the kernels are compiled for read-only bytes (see raw_rows)
    starts = np.array([p.raw.ctypes.data - flat.ctypes.data for p in parts], np.int64)
    ends = np.cumsum([p.shape[0] for p in parts]).astype(np.int64)
    return flat, starts, ends
