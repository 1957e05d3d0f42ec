"""`edgeinfer rpc-server`: this machine's ggml backend served over ggml's RPC protocol, for the
`--rpc` of the machine that runs the model (llama.cpp's rpc-server, started through the RPC
module's own entry point: edgeinfer.ggml.server)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
from enum import Enum
from typing import Annotated

import typer

from edgeinfer.errors import EdgeInferError
from edgeinfer.units import human_bytes, parse_bytes


class ServeBackend(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


def _check_listen(host: str, port: int) -> None:
    """The address must be an IPv4 one (ggml's server binds IPv4 only) that is free to bind."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise EdgeInferError(
            f"--host {host!r}: give an IPv4 address (ggml's RPC server binds IPv4 only), e.g. "
            "127.0.0.1, or 0.0.0.0 for every interface"
        ) from None
    if not 0 < port < 65536:
        raise EdgeInferError(f"--port {port}: must be 1-65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml binds it
        try:
            s.bind((host, port))
        except OSError as e:
            raise EdgeInferError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def rpc_server(
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="IPv4 address to bind. Anything but loopback exposes this machine's memory and "
            "compute to whoever can reach the port: ggml's RPC has no authentication and no "
            "encryption (trusted networks or an SSH tunnel only).",
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port to listen on.")] = 50052,
    threads: Annotated[
        int | None,
        typer.Option("--threads", "-t", help="CPU threads for the backend (default: cores)."),
    ] = None,
    mem: Annotated[
        str | None,
        typer.Option(
            "--mem",
            help="Memory to report to clients, e.g. 6G (default: the device's free memory); "
            "clients place layers and size their KV cache against it.",
        ),
    ] = None,
    backend: Annotated[
        ServeBackend,
        typer.Option("--backend", help="The device to serve: cpu, or cuda (built by make cuda)."),
    ] = ServeBackend.cpu,
) -> None:
    """Serve this machine's CPU (or GPU) to another machine's `edgeinfer run/chat/serve --rpc`
    over ggml's RPC protocol, one client at a time; Ctrl-C or SIGTERM stops it."""
    if threads is not None and threads < 1:
        raise EdgeInferError(f"--threads must be >= 1, got {threads}")
    try:
        advertised = parse_bytes(mem) if mem is not None else None
    except ValueError as e:
        raise EdgeInferError(f"--mem: {e}") from None
    if advertised is not None and advertised < 1:
        raise EdgeInferError("--mem must be at least 1 byte")
    _check_listen(host, port)
    import psutil

    from edgeinfer.ggml.backends import find_device
    from edgeinfer.ggml.lib import load
    from edgeinfer.ggml.server import AdvertisedMemory, start_server

    device = find_device(backend.value)
    wrapper = AdvertisedMemory(device, advertised) if advertised is not None else None
    n_threads = threads or psutil.cpu_count(logical=False) or 1
    lib = load()
    desc = f"{lib.ggml_backend_dev_name(device).decode()} ({lib.ggml_backend_dev_description(device).decode()})"  # noqa: E501
    if not ipaddress.IPv4Address(host).is_loopback:
        print(
            f"warning: listening on {host}:{port}, beyond this machine: ggml's RPC protocol has "
            "no authentication and no encryption; run it on a trusted network or behind an SSH "
            "tunnel only",
            file=sys.stderr,
        )
    what = f", reporting {human_bytes(advertised)}" if advertised is not None else ""
    print(f"edgeinfer rpc-server: {desc} on {host}:{port}, {n_threads} threads{what}", flush=True)

    stopped: list[int] = []
    done = threading.Event()

    def on_signal(signum, frame):
        stopped.append(signum)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    endpoint = f"{host}:{port}"

    def serve() -> None:
        start_server(endpoint, wrapper.ptr if wrapper else device, n_threads)
        done.set()  # it returned: it could not listen

    threading.Thread(target=serve, daemon=True).start()
    while not done.wait(0.5):  # (a timed wait: signal handlers run between waits)
        pass
    sys.stdout.flush()
    if not stopped:  # the server returned: it could not listen (it said why on stderr)
        raise EdgeInferError(f"ggml's RPC server could not listen on {endpoint}")
    print(f"edgeinfer rpc-server: stopped ({signal.Signals(stopped[0]).name})", file=sys.stderr)
    sys.stderr.flush()
    # the serving thread is inside ggml's accept/recv: leave without unwinding it
    os._exit(0)
