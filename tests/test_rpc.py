"""Layers on ggml RPC servers (edgeinfer.ggml.remote, `edgeinfer rpc-server`), on loopback: real
server processes at free ports, the engine's worker process as its client.

The servers run ggml's CPU backend, the same code as the local ggml CPU backend, so a split
across servers must give exactly the logits of the same split on the local backend.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
from cli_checks import edgeinfer, one_error_line
from server_proc import free_port
from test_offload import GREEDY, run_logits, tokens

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import DeviceLostError, EdgeInferError
from edgeinfer.llm import LLM

pytest.importorskip("llama_cpp")

LOCAL = "2-3@cpu,4-5+head@cpu"  # the 6-layer synthetic gemma3: layers 0-1 stay on Numba


def _module_built() -> bool:
    from edgeinfer.ggml.backends import MODULES, module_dirs

    return any((d / MODULES["rpc"]).is_file() for d in module_dirs())


if not _module_built():  # `make test` builds it; CI must not skip
    if os.environ.get("CI"):
        raise RuntimeError("ggml's RPC module is missing: `make rpc` builds it")
    pytest.skip("ggml's RPC module is not built (make rpc)", allow_module_level=True)


class RPCServer:
    """`edgeinfer rpc-server` on 127.0.0.1 (a given port, or a free one)."""

    def __init__(self, *args: str, port: int | None = None):
        from edgeinfer.ggml.rpc import RPCError, probe

        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgeinfer", "rpc-server", "--port", str(self.port),
             "--threads", "2", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                probe(self.endpoint, timeout=2)
                return
            except RPCError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    out = self.proc.communicate()
                    raise RuntimeError(f"rpc-server did not start: {out}") from None
                time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str]:
        """-> (exit code, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


@pytest.fixture(scope="module")
def servers():
    """Servers A and B, reporting 1 and 2 GiB (the automatic split follows them)."""
    a, b = RPCServer("--mem", "1G"), RPCServer("--mem", "2G")
    yield a.endpoint, b.endpoint
    for s in (a, b):
        code, err = s.stop()
        assert code == 0 and err.strip().splitlines()[-1].endswith("stopped (SIGTERM)"), err


@pytest.fixture(autouse=True)
def _release_earlier_models():
    """A server serves one client at a time: a model of an earlier test must let go of it."""
    gc.collect()


@pytest.fixture(scope="module")
def gemma(synthetic_model):
    return str(synthetic_model("gemma3", "Q8_0"))


def remote(a: str, b: str) -> str:
    return f"2-3@rpc:{a},4-5+head@rpc:{b}"


def test_a_split_across_two_servers_gives_the_local_backends_logits(gemma, servers):
    toks = tokens(300)
    llm = LLM(gemma, threads=2, ctx=64, offload=remote(*servers))
    placed = llm.placement()
    assert f"layers 2-3 on ggml RPC server {servers[0]}" in placed
    assert f"layers 4-5 + head on ggml RPC server {servers[1]}" in placed
    assert placed.endswith("layers 0-1 on edgeinfer's kernels")
    got = run_logits(llm, toks)
    want = run_logits(LLM(gemma, threads=2, ctx=64, offload=LOCAL), toks)
    assert np.array_equal(got, want)


def test_greedy_turns_with_prefix_reuse_match_the_local_split(gemma, servers):
    llm = LLM(gemma, threads=2, offload=remote(*servers))
    local = LLM(gemma, threads=2, offload=LOCAL)
    turn1 = list(range(5, 60))
    first = llm.generate(turn1, GREEDY)[0]
    assert first.token_ids == local.generate(turn1, GREEDY)[0].token_ids
    turn2 = turn1 + first.token_ids + list(range(100, 120))
    second = llm.generate(turn2, GREEDY)[0]
    assert llm.stats().prefix_cache_hit_tokens >= 48  # the first turn's full blocks
    assert second.token_ids == local.generate(turn2, GREEDY)[0].token_ids
    assert llm.kv_usage()[0] == 0


def test_rpc_alone_splits_every_layer_by_the_servers_memory(gemma, servers):
    a, b = servers
    llm = LLM(gemma, threads=2, ctx=64, rpc=f"{a},{b}")  # 1 GiB and 2 GiB: 2 and 4 layers
    assert f"layers 0-1 on ggml RPC server {a}" in llm.placement()
    assert f"layers 2-5 + head on ggml RPC server {b}" in llm.placement()
    local = LLM(gemma, threads=2, ctx=64, offload="0-1@cpu,2-5+head@cpu")
    toks = tokens(300, seed=2)
    assert np.array_equal(run_logits(llm, toks), run_logits(local, toks))
    del llm  # (info probes the servers, each serving one client at a time)
    gc.collect()
    r = edgeinfer("info", gemma, "--json", "--ctx", "64", "--rpc", f"{a},{b}")
    assert r.returncode == 0, r.stderr
    plans = json.loads(r.stdout)["devices"]
    assert [(d["span"], d["free_bytes"], d["fits"]) for d in plans] == [
        (f"layers 0-1 on ggml RPC server {a}", 1 << 30, True),
        (f"layers 2-5 + head on ggml RPC server {b}", 2 << 30, True),
    ]


def _own_connections() -> int:
    return len(psutil.Process().net_connections(kind="tcp"))


def _workers() -> list:
    """This process's ggml RPC worker processes (the servers are its children too)."""
    return [p for p in psutil.Process().children() if "edgeinfer.ggml.worker" in p.cmdline()]


def test_a_server_killed_mid_stream_fails_the_request_and_frees_everything(gemma, servers):
    c = RPCServer()
    threads, conns = threading.active_count(), _own_connections()
    try:
        llm = LLM(gemma, threads=2, offload=f"2-3@rpc:{servers[0]},4-5+head@rpc:{c.endpoint}")
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        done = llm.generate(list(range(5, 60)), params)[0]  # its blocks stay cached
        assert llm.engine.blocks.num_cached_blocks > 0
        stream = llm.stream(list(range(5, 60)), params)
        next(stream)
        c.proc.kill()
        c.proc.wait()
        with pytest.raises(DeviceLostError, match=f"{c.endpoint}: connection refused"):
            list(stream)
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks  # every block, cached ones too
        assert blocks.num_cached_blocks == 0
        assert _workers() == []  # the worker is reaped
        assert threading.active_count() == threads
        assert _own_connections() == conns
        # the server comes back on the same port: the next request reconnects
        with pytest.raises(EdgeInferError, match="connection refused"):
            llm.generate([5, 6, 7], params)
        assert llm.kv_usage()[0] == 0
        c = RPCServer(port=c.port)
        again = llm.generate(list(range(5, 60)), params)[0]
        assert again.token_ids == done.token_ids
    finally:
        c.stop()


class _NotRPC:
    """A TCP peer that answers anything with bytes no ggml RPC server would send."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.recv(64)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        except OSError:
            return

    def close(self):
        self.sock.close()


def test_bad_servers_are_one_clear_error_at_load(gemma):
    small = RPCServer("--mem", "64K")
    garbage = _NotRPC()
    try:
        cases = [
            (dict(rpc="127.0.0.1"), "expected HOST:PORT"),
            (dict(offload=f"0-5+head@rpc:127.0.0.1:{free_port()}"), "connection refused"),
            (dict(rpc=garbage.endpoint), "is not a ggml RPC server"),
            (dict(rpc=small.endpoint), f"but ggml RPC server {small.endpoint} has 64.0 KiB free"),
            (dict(rpc=small.endpoint, offload="0-5+head@cpu"), "name each server in both"),
            (dict(offload=f"0-1@rpc:{small.endpoint},3-5@cpu"), "leave a gap"),
        ]
        for knobs, needle in cases:
            with pytest.raises(EdgeInferError, match=needle.replace("+", r"\+")):
                LLM(gemma, threads=2, ctx=64, **knobs)
        assert _workers() == []
        r = edgeinfer("run", gemma, "-p", "hi", "-n", "2", "--rpc", small.endpoint)
        one_error_line(r, "64.0 KiB free")
    finally:
        garbage.close()
        code, err = small.stop(signal.SIGINT)
    assert code == 0 and err.strip().splitlines()[-1].endswith("stopped (SIGINT)"), err


def test_rpc_server_refuses_bad_options_with_one_line(servers):
    one_error_line(edgeinfer("rpc-server", "--host", "localhost"), "IPv4 address")
    port = servers[0].rpartition(":")[2]
    one_error_line(edgeinfer("rpc-server", "--port", port), f"cannot listen on 127.0.0.1:{port}")
    one_error_line(edgeinfer("rpc-server", "--mem", "lots"), "--mem")
