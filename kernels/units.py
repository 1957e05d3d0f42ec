"""A unit's parallel kernels, written once for every type: `build` makes them from the type's
serial row dequantizer (and, for a quantized type, its block dot product) and registers the unit.

Numba keys its disk cache by the function that a kernel is compiled from. A kernel made in a
closure is refused (its captured functions count as dynamic globals), and one that takes the
row function as an argument misses on every start (the argument's type is that function
object). So each type's kernels are copies of the module-level templates below under a name of
their own, each with the type's functions and constants as its globals: cached like any
module-level kernel, and compiled to the code a hand-written copy would give.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numpy as np
from numba import njit, prange

from edgeinfer.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .block_matmul import Fused, block_matmul, block_matmul_shared, parts_of
from .byte_gemm import byte_matmul, byte_tile_for
from .floatbits import HALF_TABLE
from .int8_gemm import IntGemm, int8_matmul, tile_rows
from .matmul import RowTile, row_tile_matmul
from .registry import QuantType, register

# The templates' globals that `build` sets per type: placeholders here.
DEQUANTIZE_ROW = BLOCK_DOT = UNPACK = BLOCK_MATMUL = BYTE_TILE = None
BLOCK = TYPE_SIZE = SUM_GROUP = MIN_GROUPS = INT_ROWS = 0
Q_TYPE = np.int8


# raw: [rows, row_bytes] -> out: [rows, cols]
def _dequantize_rows(raw, halves, out):
    for r in prange(raw.shape[0]):
        DEQUANTIZE_ROW(raw[r], halves, out[r])


# flat, starts, ends: one or more weights' rows of TYPE_SIZE-byte blocks (see
# matmul.row_tile_matmul), x: [n, in] -> out: [n, rows]
def _matmul_rows(flat, starts, ends, halves, x, out):
    row_tile_matmul(DEQUANTIZE_ROW, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE)


# flat, starts, ends: one or more weights' bytes (see block_matmul), x: [n, in] -> out: [n, rows]
def _matmul_fused(flat, starts, ends, halves, x, out):
    BLOCK_MATMUL(BLOCK_DOT, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE, SUM_GROUP, Q_TYPE)


# flat, starts, ends: as _matmul_fused, x: [n, in] -> out: [n, rows], int8 activations
def _matmul_int8(flat, starts, ends, halves, x, out):
    int8_matmul(UNPACK, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE, MIN_GROUPS, INT_ROWS)


# as _matmul_int8, on byte_gemm's GEMM (where the target enables it)
def _matmul_bytes(flat, starts, ends, halves, x, out):
    byte_matmul(UNPACK, BYTE_TILE, flat, starts, ends, halves, x, out, BLOCK, TYPE_SIZE)


def jit_copy(template: Callable, name: str, constants: dict, **options) -> Callable:
    """A `@njit(cache=True, **options)` copy of template (a module-level function) named `name`,
    with `constants` in place of the template's globals of those names."""
    fn = types.FunctionType(template.__code__, {**template.__globals__, **constants}, name)
    fn.__qualname__ = name  # Numba names the cache files after it
    return njit(cache=True, **options)(fn)


def with_halves(kernel: Callable) -> Callable:
    """kernel(raw, halves, *rest) -> the unit-interface f(raw, *rest), with floatbits.HALF_TABLE
    passed (an argument, not a constant compiled into every kernel: see floatbits)."""

    def call(raw, *rest):
        kernel(raw, HALF_TABLE, *rest)

    return call


def build(
    qtype: GGMLQuantizationType,
    dequantize_row: Callable,
    block_dot: Callable | None = None,
    sum_group: int = 0,
    q_type=np.int8,
    unpack: Callable | None = None,
    min_groups: int = 0,
    unpack_bytes: Callable | None = None,
    q_bits: int = 8,
    shared_unpacking: bool = False,
    **fields,
) -> QuantType:
    """Registers and returns qtype's unit, its kernels built on

    dequantize_row(raw u8[row_bytes], halves, out f32[cols]) -> None: a serial `@njit(cache=True)`
      function, bit-exact with gguf.quants.dequantize (see registry);
    block_dot: the block dot product of `block_matmul` (None: no fused small-n kernel), with
      x quantized to q_type blocks of the type's block size, summed per sum_group (see
      act_quant); shared_unpacking: whether several rows of x share each block's unpacking in
      the fused kernel (see block_matmul_shared), for the types whose unpacking costs about as
      much as their products;
    unpack, min_groups: the block's unpacking for the int8 GEMM (see int8_gemm; None: none);
    unpack_bytes, q_bits: the block's unpacking for the byte GEMM (see byte_gemm) and the bits of
      its unsigned q: it replaces the int8 GEMM where the target's byte GEMM takes such q;
    fields: the other QuantType fields (small_n_max ...), or ones to use instead of the built
      kernels (F32's numpy and BLAS ones).
    """
    block, type_size = GGML_QUANT_SIZES[qtype]
    name = qtype.name.lower()
    functions = dict(DEQUANTIZE_ROW=dequantize_row, BLOCK_DOT=block_dot, UNPACK=unpack)
    # the fused kernel's loop; a type that does not share never compiles the shared one
    functions.update(BLOCK_MATMUL=block_matmul_shared if shared_unpacking else block_matmul)
    sizes = dict(BLOCK=block, TYPE_SIZE=type_size, SUM_GROUP=sum_group, Q_TYPE=q_type)
    sizes.update(MIN_GROUPS=min_groups, INT_ROWS=tile_rows(block))
    constants = {**functions, **sizes}
    kernels = dict(matmul_small=None)
    if "dequantize_rows" not in fields:
        rows = jit_copy(_dequantize_rows, f"{name}_dequantize_rows", constants, parallel=True)
        kernels.update(dequantize_rows=with_halves(rows))
    tiles = jit_copy(_matmul_rows, f"{name}_matmul_rows", constants, parallel=True, fastmath=True)
    kernels.update(matmul_rows=RowTile(tiles))
    if block_dot is not None:
        fused = jit_copy(_matmul_fused, f"{name}_matmul_fused", constants, parallel=True)
        kernels.update(matmul_small=Fused(fused), repack=parts_of)
    byte_tile = byte_tile_for(q_bits)
    if unpack_bytes is not None and byte_tile is not None:
        byte_constants = {**constants, "UNPACK": unpack_bytes, "BYTE_TILE": byte_tile}
        gemm = jit_copy(_matmul_bytes, f"{name}_matmul_bytes", byte_constants, parallel=True)
        kernels.update(matmul_int8=IntGemm(gemm))
    elif unpack is not None:
        gemm = jit_copy(_matmul_int8, f"{name}_matmul_int8", constants, parallel=True)
        kernels.update(matmul_int8=IntGemm(gemm))
    unit = QuantType(qtype=qtype, block_size=block, type_size=type_size, **{**kernels, **fields})
    return register(unit)
