"""Opening a ggml backend by name: `cpu` (ggml's CPU backend, in llama-cpp-python's wheel) or
`cuda[:N]` (a backend module built by `make cuda` and loaded at run time with ggml_backend_load,
so it joins the same registry libllama uses).

A backend module is looked for in $EDGEINFER_GGML_MODULES, then in $EDGEINFER_HOME/ggml
(`make cuda` installs it there).
"""

from __future__ import annotations

import ctypes as C
import os
from dataclasses import dataclass
from pathlib import Path

from .lib import DEVICE_TYPE_CPU, GGMLError, load, reg_api_problems

MODULES = {"cuda": "libggml-cuda.so"}
BUILD_HINT = {
    "cuda": "build it from the pinned llama-cpp-python's source with `make cuda` (needs an NVIDIA "
    "GPU and its driver; see README, GPU offload)",
}


def module_dirs() -> list[Path]:
    from edgeinfer.gguf.hub import home

    dirs = [Path(p) for p in os.environ.get("EDGEINFER_GGML_MODULES", "").split(os.pathsep) if p]
    return [*dirs, home() / "ggml"]


def _load_module(kind: str) -> None:
    """ggml_backend_load the module for `kind` once; a missing module is one clear error."""
    lib = load()
    name = MODULES[kind]
    for i in range(lib.ggml_backend_reg_count()):
        if lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode().lower() == kind:
            return
    for d in module_dirs():
        path = d / name
        if path.is_file():
            reg = lib.ggml_backend_load(str(path).encode())
            if not reg:
                raise GGMLError(f"ggml could not load the {kind} backend module {path}")
            problems = reg_api_problems(reg)
            if problems:
                raise GGMLError(f"{path}: {problems[0]}; rebuild it ({BUILD_HINT[kind]})")
            return
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


def open_backend(name: str) -> Backend:
    """`cpu`, `cuda` (device 0) or `cuda:N` -> a ready Backend, or one GGMLError."""
    kind, _, index = name.partition(":")
    if kind != "cpu":
        if kind not in MODULES:
            raise GGMLError(f"unknown ggml backend {name!r} (use cpu, cuda or cuda:N)")
        _load_module(kind)
    devs = _devices_of(kind)
    n = int(index) if index else 0
    if n >= len(devs):
        raise GGMLError(f"ggml backend {name}: {len(devs)} {kind} device(s) found")
    ptr = load().ggml_backend_dev_init(devs[n], None)
    if not ptr:
        raise GGMLError(f"ggml could not initialise backend {name}")
    return Backend(name, ptr, devs[n])
