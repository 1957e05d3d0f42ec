"""ctypes bindings to the ggml that llama-cpp-python ships, and the ABI guard.

Only the `.so.0` files are opened: the wheel installs `.so`, `.so.0` and `.so.0.x.y` as separate
copies, and libllama links the `.so.0` names, so opening another name would load a second ggml
into the process (design.md §8). ggml has no ABI promise: struct layouts, type sizes and the
backend interface change between commits without an error, so `load()` checks them against what
these bindings were written for and refuses with one clear error (`GGMLError`) rather than risk
memory corruption; ggml aborts the process on a failed assert, so nothing here may reach it with
an unchecked shape (`graph.Builder` checks them first).
"""

from __future__ import annotations

import ctypes as C
import functools
from pathlib import Path

from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.constants import GGML_QUANT_SIZES
from edgeinfer.kernels.registry import supported_types

# What these bindings were written against: llama-cpp-python 0.3.36's ggml.
GGML_VERSION = "0.25.3"
GGML_BACKEND_API_VERSION = 2  # ggml-backend-impl.h; the first int of every ggml_backend_reg
GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
GGML_MAX_OP_PARAMS = 64
GGML_OBJECT_SIZE = 32  # struct ggml_object, which precedes every tensor in a context
DEVICE_TYPE_CPU, DEVICE_TYPE_GPU, DEVICE_TYPE_IGPU = 0, 1, 2
BUFFER_USAGE_WEIGHTS = 1
ROPE_NEOX = 2
STATUS_SUCCESS = 0


class GGMLError(EdgeInferError):
    """ggml is missing, of another version, or refused an operation."""


class Tensor(C.Structure):
    """struct ggml_tensor (ggml.h): read for ne/nb, and its size is part of the ABI guard."""

    _fields_ = [
        ("type", C.c_int),
        ("buffer", C.c_void_p),
        ("ne", C.c_int64 * GGML_MAX_DIMS),
        ("nb", C.c_size_t * GGML_MAX_DIMS),
        ("op", C.c_int),
        ("op_params", C.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", C.c_int32),
        ("src", C.c_void_p * GGML_MAX_SRC),
        ("view_src", C.c_void_p),
        ("view_offs", C.c_size_t),
        ("data", C.c_void_p),
        ("name", C.c_char * GGML_MAX_NAME),
        ("extra", C.c_void_p),
        ("padding", C.c_char * 8),
    ]


class CGraph(C.Structure):
    """struct ggml_cgraph (ggml-impl.h), read to check its layout before `uid` is written."""

    _fields_ = [
        ("size", C.c_int),
        ("n_nodes", C.c_int),
        ("n_leafs", C.c_int),
        ("nodes", C.POINTER(C.c_void_p)),
        ("grads", C.c_void_p),
        ("grad_accs", C.c_void_p),
        ("leafs", C.c_void_p),
        ("use_counts", C.c_void_p),
        ("hash_size", C.c_size_t),
        ("hash_used", C.c_void_p),
        ("hash_keys", C.c_void_p),
        ("order", C.c_int),
        ("uid", C.c_uint64),
    ]


class InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


_p, _i, _i64, _sz, _f, _b, _s = (
    C.c_void_p,
    C.c_int,
    C.c_int64,
    C.c_size_t,
    C.c_float,
    C.c_bool,
    C.c_char_p,
)
# name -> (library, result, arguments); "base" = libggml-base, "reg" = libggml, "cpu" = libggml-cpu
_SIGNATURES = {
    "ggml_version": ("base", _s, []),
    "ggml_commit": ("base", _s, []),
    "ggml_tensor_overhead": ("base", _sz, []),
    "ggml_graph_overhead_custom": ("base", _sz, [_sz, _b]),
    "ggml_type_size": ("base", _sz, [_i]),
    "ggml_blck_size": ("base", _i64, [_i]),
    "ggml_nbytes": ("base", _sz, [_p]),
    "ggml_init": ("base", _p, [InitParams]),
    "ggml_free": ("base", None, [_p]),
    "ggml_new_tensor_1d": ("base", _p, [_p, _i, _i64]),
    "ggml_new_tensor_2d": ("base", _p, [_p, _i, _i64, _i64]),
    "ggml_new_tensor_3d": ("base", _p, [_p, _i, _i64, _i64, _i64]),
    "ggml_set_name": ("base", _p, [_p, _s]),
    "ggml_set_input": ("base", None, [_p]),
    "ggml_set_output": ("base", None, [_p]),
    "ggml_view_2d": ("base", _p, [_p, _p, _i64, _i64, _sz, _sz]),
    "ggml_view_4d": ("base", _p, [_p, _p, _i64, _i64, _i64, _i64, _sz, _sz, _sz, _sz]),
    "ggml_reshape_2d": ("base", _p, [_p, _p, _i64, _i64]),
    "ggml_reshape_3d": ("base", _p, [_p, _p, _i64, _i64, _i64]),
    "ggml_permute": ("base", _p, [_p, _p, _i, _i, _i, _i]),
    "ggml_mul_mat": ("base", _p, [_p, _p, _p]),
    "ggml_add": ("base", _p, [_p, _p, _p]),
    "ggml_mul": ("base", _p, [_p, _p, _p]),
    "ggml_rms_norm": ("base", _p, [_p, _p, _f]),
    "ggml_rope_ext": ("base", _p, [_p, _p, _p, _p, _i, _i, _i, _f, _f, _f, _f, _f, _f]),
    "ggml_set_rows": ("base", _p, [_p, _p, _p, _p]),
    "ggml_get_rows": ("base", _p, [_p, _p, _p]),
    "ggml_flash_attn_ext": ("base", _p, [_p, _p, _p, _p, _p, _f, _f, _f]),
    "ggml_swiglu_split": ("base", _p, [_p, _p, _p]),
    "ggml_geglu_split": ("base", _p, [_p, _p, _p]),
    "ggml_new_graph_custom": ("base", _p, [_p, _sz, _b]),
    "ggml_build_forward_expand": ("base", None, [_p, _p]),
    "ggml_graph_n_nodes": ("base", _i, [_p]),
    "ggml_graph_node": ("base", _p, [_p, _i]),
    "ggml_graph_next_uid": ("base", C.c_uint64, []),
    "ggml_backend_alloc_ctx_tensors": ("base", _p, [_p, _p]),
    "ggml_backend_buffer_free": ("base", None, [_p]),
    "ggml_backend_buffer_clear": ("base", None, [_p, C.c_uint8]),
    "ggml_backend_buffer_get_size": ("base", _sz, [_p]),
    "ggml_backend_buffer_set_usage": ("base", None, [_p, _i]),
    "ggml_backend_cpu_buffer_from_ptr": ("base", _p, [_p, _sz]),
    "ggml_backend_tensor_alloc": ("base", _i, [_p, _p, _p]),
    "ggml_backend_tensor_set": ("base", None, [_p, _p, _sz, _sz]),
    "ggml_backend_tensor_get": ("base", None, [_p, _p, _sz, _sz]),
    "ggml_backend_get_default_buffer_type": ("base", _p, [_p]),
    "ggml_backend_graph_compute": ("base", _i, [_p, _p]),
    "ggml_backend_supports_op": ("base", _b, [_p, _p]),
    "ggml_backend_free": ("base", None, [_p]),
    "ggml_backend_name": ("base", _s, [_p]),
    "ggml_backend_get_device": ("base", _p, [_p]),
    "ggml_backend_dev_name": ("base", _s, [_p]),
    "ggml_backend_dev_description": ("base", _s, [_p]),
    "ggml_backend_dev_memory": ("base", None, [_p, C.POINTER(_sz), C.POINTER(_sz)]),
    "ggml_backend_dev_type": ("base", _i, [_p]),
    "ggml_backend_dev_init": ("base", _p, [_p, _s]),
    "ggml_backend_dev_backend_reg": ("base", _p, [_p]),
    "ggml_backend_reg_name": ("base", _s, [_p]),
    "ggml_backend_reg_get_proc_address": ("base", _p, [_p, _s]),
    "ggml_backend_reg_dev_count": ("base", _sz, [_p]),
    "ggml_backend_reg_dev_get": ("base", _p, [_p, _sz]),
    "ggml_gallocr_new": ("base", _p, [_p]),
    "ggml_gallocr_free": ("base", None, [_p]),
    "ggml_gallocr_reserve": ("base", _b, [_p, _p]),
    "ggml_gallocr_alloc_graph": ("base", _b, [_p, _p]),
    "ggml_gallocr_get_buffer_size": ("base", _sz, [_p, _i]),
    "ggml_backend_load": ("reg", _p, [_s]),
    "ggml_backend_reg_count": ("reg", _sz, []),
    "ggml_backend_reg_get": ("reg", _p, [_sz]),
    "ggml_backend_dev_count": ("reg", _sz, []),
    "ggml_backend_dev_get": ("reg", _p, [_sz]),
    "ggml_backend_device_register": ("reg", None, [_p]),
    "ggml_backend_cpu_set_n_threads": ("cpu", None, [_p, _i]),
    "ggml_backend_cpu_set_use_ref": ("cpu", None, [_p, _b]),
    "ggml_backend_is_cpu": ("cpu", _b, [_p]),
}


class _Lib:
    """The bound functions as attributes: `lib.ggml_add(ctx, a, b)`."""

    def __init__(self, directory: Path):
        self.directory = directory
        # RTLD_GLOBAL: a backend module loaded later (ggml_backend_load) resolves ggml-base's
        # symbols against this copy, the one libllama uses.
        libs = {
            key: C.CDLL(str(directory / f"{name}.so.0"), mode=C.RTLD_GLOBAL)
            for key, name in (("base", "libggml-base"), ("cpu", "libggml-cpu"), ("reg", "libggml"))
        }
        for name, (lib, res, args) in _SIGNATURES.items():
            fn = getattr(libs[lib], name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)


def library_dir() -> Path:
    try:
        import llama_cpp
    except ImportError as e:
        raise GGMLError(
            f"ggml offload needs llama-cpp-python (pip install llama-cpp-python): {e}"
        ) from None
    return Path(llama_cpp.__file__).parent / "lib"


@functools.cache
def load() -> _Lib:
    """The bindings, after the ABI guard. Raises GGMLError once per call until it succeeds."""
    directory = library_dir()
    try:
        lib = _Lib(directory)
    except (OSError, AttributeError) as e:
        raise GGMLError(f"cannot load ggml from {directory}: {e}") from None
    check_abi(lib)
    return lib


def check_abi(lib: _Lib) -> None:
    """Refuse a ggml whose layouts differ from the ones these bindings assume."""
    version = lib.ggml_version().decode()
    problems = []
    if version != GGML_VERSION:
        problems.append(f"ggml version {version}, expected {GGML_VERSION}")
    overhead = lib.ggml_tensor_overhead()
    if overhead != C.sizeof(Tensor) + GGML_OBJECT_SIZE:
        problems.append(
            f"ggml_tensor_overhead() = {overhead}, expected {C.sizeof(Tensor) + GGML_OBJECT_SIZE}"
        )
    # every weight type edgeinfer's kernels support must mean the same bytes to ggml
    for t in supported_types():
        block, size = GGML_QUANT_SIZES[t]
        got = (lib.ggml_blck_size(int(t)), lib.ggml_type_size(int(t)))
        if got != (block, size):
            problems.append(f"type {t.name}: block/size {got}, expected {(block, size)}")
    for i in range(lib.ggml_backend_reg_count()):
        problems += reg_api_problems(lib.ggml_backend_reg_get(i))
    if problems:
        raise GGMLError(
            "the ggml in llama-cpp-python does not match edgeinfer's bindings ("
            + "; ".join(problems)
            + "); install the pinned llama-cpp-python (pyproject.toml)"
        )


def reg_api_problems(reg: int) -> list[str]:
    """A backend registry whose interface version is not the one expected."""
    api = C.cast(reg, C.POINTER(C.c_int))[0]
    if api != GGML_BACKEND_API_VERSION:
        return [f"backend API version {api}, expected {GGML_BACKEND_API_VERSION}"]
    return []


def tensor(ptr: int) -> Tensor:
    return Tensor.from_address(ptr)
