"""edgeinfer.kernels: dequantization and matmul on GGML-typed weights, straight from file bytes.

    dequantize(data, qtype, shape) -> float32 array of `shape`   (bit-exact with gguf.quants)
    QuantWeight.from_raw(data, qtype, shape)   .shape (out, in) .qtype .nbytes .extra_nbytes
    matmul(x, w)      # x: float32[n, in], w: [out, in] -> float32[n, out]
    bind_stacked(parts, stack(parts))(x)   # several weights of one type, one launch
    bind_small(parts) -> (f, n_max)   # fused small-n calls on parts of one or more types
    bind_row_wise(parts)(x)   # the same on matmul's row-wise path
    takes_int8_rows(unit)     # do n = small_n_max+1 .. rows_n_max take the int8 GEMM?
    embedding(w, ids) # w: [vocab, dim], ids: int[n] -> float32[n, dim]
    set_threads(n) / get_threads()

One unit per GGML type, built by its family's module (floats, legacy, kquants) and registered
in `registry` (see its docstring for the unit interface).
"""

if __name__ != "edgeinfer.kernels":
    # Numba's on-disk cache records the module name; the same files imported as a top-level
    # `kernels` (cwd on sys.path) would write entries that `edgeinfer.kernels` cannot load.
    raise ImportError(f"import this package as edgeinfer.kernels, not {__name__}")

from pathlib import Path  # noqa: E402

from edgeinfer.gc_pause import start_up  # noqa: E402

from .numba_import import import_numba  # noqa: E402

with start_up("import kernels"):
    import_numba()
    from . import cache_load
    from .cache_stamp import refresh

    refresh(Path(__file__).parent)  # before any kernel is loaded from the disk cache
    cache_load.install()

    import numpy as np

    from . import threads
    from .matmul import (
        bind_row_wise,
        bind_small,
        bind_stacked,
        embedding,
        matmul,
        takes_int8_rows,
    )
    from .registry import (
        QuantType,
        UnsupportedTypeError,
        as_qtype,
        get_unit,
        register,
        supported_types,
    )
    from .threads import get_threads, set_threads
    from .weight import QuantWeight, raw_rows, stack


def dequantize(data: np.ndarray, qtype, shape) -> np.ndarray:
    """data: a tensor's bytes as in the file (uint8); shape: rows-first -> float32[shape]."""
    unit = get_unit(as_qtype(qtype))
    shape = tuple(int(s) for s in shape)
    raw = raw_rows(data, unit, shape)
    out = np.empty((raw.shape[0], shape[-1]), np.float32)
    threads.apply()
    unit.dequantize_rows(raw, out)
    return out.reshape(shape)


__all__ = [
    "QuantType",
    "QuantWeight",
    "UnsupportedTypeError",
    "bind_row_wise",
    "bind_small",
    "bind_stacked",
    "dequantize",
    "embedding",
    "get_threads",
    "get_unit",
    "matmul",
    "register",
    "set_threads",
    "stack",
    "supported_types",
    "takes_int8_rows",
]
