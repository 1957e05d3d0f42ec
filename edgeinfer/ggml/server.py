"""The server side of ggml's RPC: this machine's device served to another machine's `--rpc`
through the RPC module's own entry point, ggml_backend_rpc_start_server (llama.cpp's
rpc-server does the same; no llama.cpp binary is built).

`mem` makes the device report that many bytes free and total to clients (llama.cpp's
rpc-server -m did the same): clients plan their layers and KV cache against it. It wraps the
device in a copy whose get_memory answers `mem`, and points each backend the server creates at
the copy (the server asks a backend's device for its memory); the offset of that pointer is
checked against ggml_backend_get_device before it is ever written.
"""

from __future__ import annotations

import ctypes as C

from .backends import rpc_function
from .lib import GGMLError, load

DEVICE_IFACE = 15  # function pointers in ggml_backend_device_i (ggml-backend-impl.h)
GET_MEMORY, INIT_BACKEND = 2, 5  # their places
BACKEND_DEVICE = 17  # ggml_backend: guid, 16 function pointers of ggml_backend_i, device

_GetMemory = C.CFUNCTYPE(None, C.c_void_p, C.POINTER(C.c_size_t), C.POINTER(C.c_size_t))
_InitBackend = C.CFUNCTYPE(C.c_void_p, C.c_void_p, C.c_char_p)


class _Device(C.Structure):
    _fields_ = [("iface", C.c_void_p * DEVICE_IFACE), ("reg", C.c_void_p), ("context", C.c_void_p)]


class AdvertisedMemory:
    """A copy of `device` that reports `mem` bytes free and total; `.ptr` is the copy."""

    def __init__(self, device: int, mem: int):
        lib = load()
        probe = lib.ggml_backend_dev_init(device, None)
        if not probe:
            raise GGMLError("ggml could not initialise the device")
        slot = C.cast(probe, C.POINTER(C.c_void_p))[BACKEND_DEVICE]
        found = lib.ggml_backend_get_device(probe)
        lib.ggml_backend_free(probe)
        if slot != found:
            raise GGMLError("--mem does not fit this ggml's backend layout; leave it out")
        real = _Device.from_address(device)
        self.copy = _Device(real.iface, real.reg, real.context)
        self.ptr = C.addressof(self.copy)
        real_init = _InitBackend(real.iface[INIT_BACKEND])

        def get_memory(dev, free, total):
            free[0] = total[0] = mem

        def init_backend(dev, params):
            backend = real_init(device, params)
            if backend:
                C.cast(backend, C.POINTER(C.c_void_p))[BACKEND_DEVICE] = self.ptr
            return backend

        # the callbacks live as long as this object (the server's lifetime)
        self._callbacks = (_GetMemory(get_memory), _InitBackend(init_backend))
        self.copy.iface[GET_MEMORY] = C.cast(self._callbacks[0], C.c_void_p).value
        self.copy.iface[INIT_BACKEND] = C.cast(self._callbacks[1], C.c_void_p).value


def start_server(endpoint: str, device: int, threads: int) -> None:
    """Serve `device` at HOST:PORT, one client at a time; returns only if it cannot listen."""
    start = rpc_function(
        "ggml_backend_rpc_start_server",
        None,
        C.c_char_p,
        C.c_char_p,
        C.c_size_t,
        C.c_size_t,
        C.POINTER(C.c_void_p),
    )
    devices = (C.c_void_p * 1)(device)
    start(endpoint.encode(), None, threads, 1, devices)
