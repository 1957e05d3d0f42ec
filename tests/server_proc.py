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


def wait_for(condition, timeout: float = 60) -> None:
    """Poll condition() until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model, *args: str, warm: bool = True, headers: dict | None = None):
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
        self.headers: dict[str, str] = dict(headers or {})  # sent with every request
        self.health_statuses: list[int] = []  # what /health answered while starting
        self.loading_response: httpx.Response | None = None  # its first 503
        self.wait_ready()
        if warm:  # compile every kernel once, outside any test's timing
            resp = self.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=600)
            resp.raise_for_status()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                resp = httpx.get(self.url + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            self.health_statuses.append(resp.status_code)
            if resp.status_code == 503 and self.loading_response is None:
                self.loading_response = resp
            if resp.status_code == 200:
                return
            time.sleep(0.05)
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
