"""One kernel unit per GGML tensor type, keyed by `GGMLQuantizationType`.

The units are built by family modules (`floats`: F32, F16, BF16; `legacy`: Q4_0 ... Q8_0;
`kquants`: Q2_K ... Q6_K), each type's row dequantizer and block dot product there and its
parallel kernels made by `units.build`, which registers them. Which family implements which
type is the table `edgeinfer.gguf.tensor_types.KERNEL_FAMILIES` (the one list of supported
types); `get_unit(qtype)` imports that family's module on first use, so `import
edgeinfer.kernels` stays cheap.

Unit interface (a `QuantType`):

- `block_size`, `type_size`: elements and bytes per block (`gguf.GGML_QUANT_SIZES`).
- `dequantize_rows(raw, out)`: a `@njit(parallel=True, cache=True)` kernel (plain numpy for
  F32); raw: uint8[rows, row_bytes] (C-contiguous), out: float32[rows, cols] -> None.
  Bit-exact with `gguf.quants.dequantize`: compute exactly its float32 expression (no fastmath,
  no FMA contraction). The generic large-n matmul and `embedding` are built on it.
- `repack(raw) -> tuple[np.ndarray, ...]`: load-time layout for the small-n kernel, called once per
  weight with raw: uint8[out, row_bytes] (a view of the memory-mapped file). Return views of `raw`
  where possible; arrays that are not views count as the weight's `extra_nbytes`, which must stay
  <= 10 % of `raw.nbytes`. Default: `(raw,)`.
- `matmul_small(packed, x, out)`: fused dequant-matmul for small n, never materialising W in
  float; packed: the tuple from `repack`, x: float32[n, in] (C), out: float32[n, out] (C) -> None.
  Multi-threaded with prange (the caller has applied the `kernels.threads` knob); BLAS-backed
  work is split with `kernels.threads.run_split` (BLAS itself runs single-threaded).
  The quantized units' is `kernels.block_matmul` (int8 activations, one dot product per block
  written by the type), a `block_matmul.Fused`, whose `bind(packed)` gives `bind_small` the
  compiled kernel with the weight's arguments bound.
- `small_n_max`: largest n routed to `matmul_small` (matmul_small None: no fused kernel).
  Set it from measurement: the n where `matmul_rows` becomes faster.
- `matmul_rows(parts, x, out)`: mid-n matmul on the raw bytes (parts: (flat, starts, ends), a
  weight's `row_parts` or several weights' `weight.stack_rows`, x: float32[n, in] (C),
  out: float32[n, out] (C) -> None), a `kernels.matmul.RowTile`, for small_n_max < n <=
  `rows_n_max`; larger n go to the generic path in `kernels/matmul.py` (dequantize cache-sized
  row tiles with `dequantize_rows`, multiply with BLAS). Every unit has one: it also serves every
  n of the row-wise (batch-invariant) path, so each output row must be computed on its own, its
  bits independent of n and of the threads (`matmul.row_tile_matmul` does that).
- `matmul_int8(parts, x, out)`: as `matmul_rows`, with x rounded row by row to int8 blocks
  (`kernels.int8_gemm`: the quantized units'; `kernels.byte_gemm` for the K-quants where the
  target has AVX-512 VNNI), each row on its own too; `int8_faster`: it beats
  `matmul_rows` at prompt sizes, so the row-wise int8 path (prompt rows, precision "fast")
  takes it; `int8_rows`: it beats `matmul_rows` from small_n_max to rows_n_max rows too, so the
  default path takes it there (decode steps of many sequences, `matmul.takes_int8_rows`).

`dequantize_rows` and `matmul_rows` are built on the type's serial row dequantizer
(`dequantize_row(raw u8[row_bytes], halves, out f32[cols])`, halves: `floatbits.HALF_TABLE`, for
float16 scales), bit-exact like `dequantize_rows`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from edgeinfer.gguf.tensor_types import KERNEL_FAMILIES


def _identity_repack(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    return (raw,)


@dataclass(frozen=True)
class QuantType:
    qtype: GGMLQuantizationType
    block_size: int
    type_size: int
    dequantize_rows: Callable  # (raw u8[rows, row_bytes], out f32[rows, cols]) -> None
    matmul_small: Callable | None  # (packed tuple, x f32[n, in], out f32[n, out]) -> None
    repack: Callable = _identity_repack  # (raw u8[out, row_bytes]) -> packed tuple
    small_n_max: int = 16
    matmul_rows: Callable | None = None  # ((flat, starts, ends), x f32[n, in], out f32[n, out])
    rows_n_max: int = 64  # above it, BLAS on dequantized tiles is faster
    matmul_int8: Callable | None = None  # ((flat, starts, ends), x f32[n, in], out f32[n, out])
    # matmul_int8 beats matmul_rows on prompt rows: bind_row_wise(int8=True) takes it
    int8_faster: bool = False
    # ... and for small_n_max < n <= rows_n_max too: the default path takes it there
    int8_rows: bool = False

    def __post_init__(self):
        if (self.block_size, self.type_size) != GGML_QUANT_SIZES[self.qtype]:
            raise ValueError(f"{self.qtype.name}: block/type size disagree with GGML_QUANT_SIZES")

    def bind_small(self, packed: tuple) -> Callable:
        """-> f(x, out) = matmul_small(packed, x, out), for a weight called many times."""
        bind = getattr(self.matmul_small, "bind", None)
        return bind(packed) if bind is not None else partial(self.matmul_small, packed)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_size * self.type_size


class UnsupportedTypeError(EdgeInferError, NotImplementedError):
    """A tensor type edgeinfer has no kernels for (e.g. the IQ types)."""


_UNITS: dict[GGMLQuantizationType, QuantType] = {}


def register(unit: QuantType) -> QuantType:
    _UNITS[unit.qtype] = unit
    return unit


def _load_family(module: str) -> None:
    """Import a family module (it registers its units), and check it built every type the
    table gives it."""
    importlib.import_module(f"{__package__}.{module}")
    missing = [t.name for t, m in KERNEL_FAMILIES.items() if m == module and t not in _UNITS]
    if missing:
        raise RuntimeError(f"kernels/{module}.py registers no unit for {', '.join(missing)}")


def as_qtype(qtype: GGMLQuantizationType | str | int) -> GGMLQuantizationType:
    if isinstance(qtype, str):
        try:
            return GGMLQuantizationType[qtype.upper()]
        except KeyError:
            raise ValueError(f"unknown GGML type {qtype!r}") from None
    return GGMLQuantizationType(qtype)


def get_unit(qtype: GGMLQuantizationType | str | int) -> QuantType:
    qt = as_qtype(qtype)
    unit = _UNITS.get(qt)
    if unit is None:
        module = KERNEL_FAMILIES.get(qt)
        if module is None:
            supported = ", ".join(t.name for t in supported_types())
            raise UnsupportedTypeError(
                f"no kernels for GGML type {qt.name} (supported: {supported})"
            )
        _load_family(module)
        unit = _UNITS[qt]
    return unit


def supported_types() -> list[GGMLQuantizationType]:
    return sorted(KERNEL_FAMILIES, key=int)
