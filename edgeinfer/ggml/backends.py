"""Opening a ggml backend by name: `cpu` (ggml's CPU backend, in llama-cpp-python's wheel),
`cuda[:N]` (a backend module built by `make cuda` and loaded at run time with ggml_backend_load,
so it joins the same registry libllama uses) or `rpc:HOST:PORT` (a ggml RPC server, through the
module `make rpc` builds: only ever in a worker process, since its client aborts the process
when the server is lost; see remote.py).

A backend module is looked for in $EDGEINFER_GGML_MODULES, then in $EDGEINFER_HOME/ggml
(`make cuda` and `make rpc` install them there).
"""

from __future__ import annotations

import ctypes as C
import os
from dataclasses import dataclass
from pathlib import Path

from .lib import DEVICE_TYPE_CPU, GGMLError, load, reg_api_problems

MODULES = {"cuda": "libggml-cuda.so", "rpc": "libggml-rpc.so"}
BUILD_HINT = {
    "cuda": "build it from the pinned llama-cpp-python's source with `make cuda` (needs an NVIDIA "
    "GPU and its driver; see README, GPU offload)",
    "rpc": "build it from the pinned llama-cpp-python's source with `make rpc` (a C++ compiler "
    "and cmake, about a minute; see README, Layers on other machines)",
}


def module_dirs() -> list[Path]:
    from edgeinfer.gguf.hub import home

    dirs = [Path(p) for p in os.environ.get("EDGEINFER_GGML_MODULES", "").split(os.pathsep) if p]
    return [*dirs, home() / "ggml"]


def load_module(kind: str) -> int:
    """ggml_backend_load the module for `kind` once -> its registry; a missing module is one
    clear error."""
    lib = load()
    name = MODULES[kind]
    for i in range(lib.ggml_backend_reg_count()):
        reg = lib.ggml_backend_reg_get(i)
        if lib.ggml_backend_reg_name(reg).decode().lower() == kind:
            return reg
    for d in module_dirs():
        path = d / name
        if path.is_file():
            reg = lib.ggml_backend_load(str(path).encode())
            if not reg:
                raise GGMLError(f"ggml could not load the {kind} backend module {path}")
            problems = reg_api_problems(reg)
            if problems:
                raise GGMLError(f"{path}: {problems[0]}; rebuild it ({BUILD_HINT[kind]})")
            return reg
    where = ", ".join(str(d) for d in module_dirs())
    raise GGMLError(f"no ggml {kind} backend: {name} is not in {where}; {BUILD_HINT[kind]}")


@dataclass
class Backend:
    """An initialised ggml backend and its device; `close()` frees it."""

    name: str  # as the user wrote it: cpu, cuda, cuda:1
    ptr: int
    device: int

    @property
    def is_host(self) -> bool:
        """Whether the device computes in this process's RAM (weights can stay mapped)."""
        return load().ggml_backend_dev_type(self.device) == DEVICE_TYPE_CPU

    def describe(self) -> str:
        lib = load()
        return (
            f"{lib.ggml_backend_dev_name(self.device).decode()} "
            f"({lib.ggml_backend_dev_description(self.device).decode()})"
        )

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as ggml reports them."""
        free, total = C.c_size_t(), C.c_size_t()
        load().ggml_backend_dev_memory(self.device, C.byref(free), C.byref(total))
        return free.value, total.value

    def set_threads(self, n: int) -> None:
        lib = load()
        if lib.ggml_backend_is_cpu(self.ptr):
            lib.ggml_backend_cpu_set_n_threads(self.ptr, n)

    def set_reference(self, on: bool) -> bool:
        """ggml's reference kernels (no tiling, no KV splits), which give a token the same bits
        whatever it is batched with -> whether the backend has them (only the CPU backend)."""
        lib = load()
        if not lib.ggml_backend_is_cpu(self.ptr):
            return False
        lib.ggml_backend_cpu_set_use_ref(self.ptr, on)
        return True

    def close(self) -> None:
        if self.ptr:
            load().ggml_backend_free(self.ptr)
            self.ptr = 0


def _devices_of(kind: str) -> list[int]:
    lib = load()
    devs = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        if lib.ggml_backend_reg_name(reg).decode().lower() == kind:
            devs.append(dev)
    return devs


def rpc_function(name: str, restype, *argtypes):
    """A function of the RPC module that ggml hands out by name (ggml_backend_rpc_add_server,
    ggml_backend_rpc_start_server), typed."""
    lib = load()
    ptr = lib.ggml_backend_reg_get_proc_address(load_module("rpc"), name.encode())
    if not ptr:
        raise GGMLError(f"the ggml RPC module has no {name}; rebuild it ({BUILD_HINT['rpc']})")
    return C.CFUNCTYPE(restype, *argtypes)(ptr)


def _open_rpc(name: str) -> Backend:
    """rpc:HOST:PORT -> the server's first device. Aborts the process if the server is not
    there (ggml's client): callers probe it first (rpc.probe) and run in a worker process."""
    endpoint = name.partition(":")[2]
    add_server = rpc_function("ggml_backend_rpc_add_server", C.c_void_p, C.c_char_p)
    reg = add_server(endpoint.encode())
    lib = load()
    if not reg or not lib.ggml_backend_reg_dev_count(reg):
        raise GGMLError(f"ggml RPC server {endpoint} has no device")
    dev = lib.ggml_backend_reg_dev_get(reg, 0)
    ptr = lib.ggml_backend_dev_init(dev, None)
    if not ptr:
        raise GGMLError(f"ggml could not initialise backend {name}")
    return Backend(name, ptr, dev)


def find_device(name: str) -> int:
    """`cpu`, `cuda` (device 0) or `cuda:N` -> its ggml device, or one GGMLError."""
    kind, _, index = name.partition(":")
    if kind != "cpu":
        if kind not in MODULES or kind == "rpc":
            raise GGMLError(f"unknown ggml backend {name!r} (use cpu, cuda, cuda:N or rpc:...)")
        load_module(kind)
    devs = _devices_of(kind)
    n = int(index) if index else 0
    if n >= len(devs):
        raise GGMLError(f"ggml backend {name}: {len(devs)} {kind} device(s) found")
    return devs[n]


def open_backend(name: str) -> Backend:
    """`cpu`, `cuda` (device 0), `cuda:N` or `rpc:HOST:PORT` -> a ready Backend, or one
    GGMLError."""
    if name.startswith("rpc:"):
        return _open_rpc(name)
    dev = find_device(name)
    ptr = load().ggml_backend_dev_init(dev, None)
    if not ptr:
        raise GGMLError(f"ggml could not initialise backend {name}")
    return Backend(name, ptr, dev)
