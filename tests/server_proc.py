"""A real `edgeinfer serve` process on 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# The first request of a fresh checkout compiles the kernels (minutes on a busy 2-core box).
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model, *args: str, warm: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "edgeinfer", "serve", str(model), "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, "--threads", "2", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.headers: dict[str, str] = {}
        self.wait_ready()
        if warm:  # compile every kernel once, outside any test's timing
            self.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=600)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready in {START_TIMEOUT_S} s:\n{self.output()}")

    def post(self, path: str, body, timeout: float = 120, **kw) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        return httpx.post(self.url + path, json=body, timeout=timeout, headers=headers, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        return httpx.get(self.url + path, timeout=30, headers=headers, **kw)

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (summed over label sets that match `labels`)."""
        total, found = 0.0, False
        for line in self.get("/metrics").text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            key, value = line.rsplit(" ", 1)
            metric, _, rest = key.partition("{")
            if metric != name or not all(f'{k}="{v}"' in rest for k, v in labels.items()):
                continue
            total, found = total + float(value), True
        if not found:
            raise KeyError(name)
        return total

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)
