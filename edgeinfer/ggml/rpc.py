"""ggml RPC servers checked from Python, before any ggml call reaches them.

ggml's RPC client aborts the whole process when a server cannot be reached, answers malformed
data or disappears mid-call (GGML_ABORT / RPC_STATUS_ASSERT in ggml-rpc.cpp), so the engine
never loads it: a worker process does (remote.py). Here, with timeouts and one clear error
each, the engine asks every server what ggml's client would: HELLO (the protocol version),
DEVICE_COUNT and GET_DEVICE_MEMORY (its free memory, for the split and the memory check).
Every reply's size is checked before it is read. A server serves one client at a time, so a
probe that gets no answer names that as the likely reason.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from edgeinfer.units import human_bytes

from .lib import GGMLError

# ggml-rpc.h and ggml-rpc.cpp of the pinned llama-cpp-python (0.3.36)
PROTO_MAJOR, PROTO_MINOR = 7, 0
CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 11, 14, 15
CONN_CAPS = 24  # bytes of transport capabilities in HELLO; zeros: plain TCP
TIMEOUT_S = 5.0


class RPCError(GGMLError):
    """A ggml RPC server that cannot serve: unreachable, busy, another protocol, too small."""


@dataclass(frozen=True)
class ServerInfo:
    endpoint: str
    version: str
    devices: int
    free: int  # bytes, as the server reports for its first device (rpc-server --mem sets it)
    total: int


def _recv(s: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("closed the connection")
        data += chunk
    return bytes(data)


def _call(s: socket.socket, cmd: int, payload: bytes, reply_size: int) -> bytes:
    """| cmd u8 | size u64 | payload | -> the reply, after checking its size u64."""
    s.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv(s, 8))
    if size != reply_size:
        raise ValueError(f"a reply of {size} bytes to command {cmd}, expected {reply_size}")
    return _recv(s, size)


def probe(endpoint: str, timeout: float = TIMEOUT_S) -> ServerInfo:
    """Ask the server at HOST:PORT its version, devices and free memory -> ServerInfo, or one
    RPCError saying what is wrong."""
    host, _, port = endpoint.rpartition(":")
    where = f"ggml RPC server {endpoint}"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # ggml's RPC is IPv4
            s.settimeout(timeout)
            s.connect((host, int(port)))
            major, minor, patch = _call(s, CMD_HELLO, bytes(CONN_CAPS), 4 + CONN_CAPS)[:3]
            if major != PROTO_MAJOR or minor > PROTO_MINOR:
                raise RPCError(
                    f"{where} speaks RPC protocol {major}.{minor}.{patch}, edgeinfer's ggml "
                    f"{PROTO_MAJOR}.{PROTO_MINOR}.x: run `edgeinfer rpc-server` of the same "
                    "llama-cpp-python there"
                )
            (devices,) = struct.unpack("<I", _call(s, CMD_DEVICE_COUNT, b"", 4))
            if devices < 1:
                raise RPCError(f"{where} has no device")
            reply = _call(s, CMD_GET_DEVICE_MEMORY, struct.pack("<I", 0), 16)
            free, total = struct.unpack("<QQ", reply)
    except TimeoutError:
        raise RPCError(
            f"{where} did not answer within {timeout:g} s (it serves one client at a time: is "
            "another edgeinfer or llama.cpp connected to it?)"
        ) from None
    except ConnectionRefusedError:
        raise RPCError(
            f"{where}: connection refused (is `edgeinfer rpc-server --host HOST --port PORT` "
            "running there?)"
        ) from None
    except socket.gaierror:
        raise RPCError(f"{where}: unknown host {host!r}") from None
    except ValueError as e:  # a malformed reply
        raise RPCError(f"{where} is not a ggml RPC server of this version ({e})") from None
    except OSError as e:
        raise RPCError(f"{where}: {e.strerror or e}") from None
    return ServerInfo(endpoint, f"{major}.{minor}.{patch}", devices, free, total)


def free_memory(endpoints: list[str]) -> dict[str, int]:
    """Each server's free memory (endpoint -> bytes), probed: one clear error if one cannot
    serve."""
    return {ep: probe(ep).free for ep in endpoints}


def check_fits(info: ServerInfo, what: str, need: dict[str, int]) -> None:
    """Refuse a placement whose parts on one server exceed its free memory."""
    total = sum(need.values())
    if total > info.free:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in need.items())
        raise RPCError(
            f"{what} needs {human_bytes(total)} ({parts}), but ggml RPC server {info.endpoint} "
            f"has {human_bytes(info.free)} free; place fewer layers there or use a smaller "
            "--ctx, --parallel or --kv-budget"
        )
