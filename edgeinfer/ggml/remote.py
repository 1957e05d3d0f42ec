"""Spans on ggml RPC servers, run by a worker process that owns ggml's RPC client.

Why a process: ggml's client aborts the whole process when a server disappears or answers
malformed data (ggml-rpc.cpp), so it runs in a child, whose death is one clear error here.
The worker holds the spans' graphs, their weights uploaded to the servers and their KV cache
there (SpanExecutor, as for a local device); each step the engine sends it the residual stream
and the batch (positions, slots, block tables: the same block ids mean the same rows on every
server) and gets the last span's output back, over a local socket. The network traffic is
ggml's own, byte for byte what llama.cpp's RPC split sends for the same layers.

When a server is lost mid-step the worker dies (or, for a peer gone silent, gives no answer
within STEP_TIMEOUT_S and is killed): the step raises DeviceLostError naming the server, the
engine fails the requests holding KV blocks and forgets its cached prefixes (their K/V on the
servers are gone), and the next step starts a fresh worker, which probes the servers again,
reconnects and uploads the spans' weights again (as long as the first load took: the weights'
bytes over the network, e.g. ~9 s per GB at 1 Gbit/s).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from socket import socketpair

import numpy as np

from edgeinfer.errors import DeviceLostError

from .executor import total_bytes
from .lib import GGMLError
from .placement import Span, endpoint
from .rpc import RPCError, check_fits, probe
from .span import SpanExecutor
from .worker import BATCH_FIELDS

STEP_TIMEOUT_S = 600.0  # a step with no answer after this: the server is taken for lost
LOAD_TIMEOUT_S = 3600.0  # the weights' upload over a slow link
ERROR_TAIL = 400  # characters of the worker's last output quoted in an error


class RemoteSpans:
    """`parts` (consecutive spans, each on an RPC server) of the model at `path`.
    plan: (num_blocks, block_size, kv_dtype, max_tokens, max_logit_rows) as SpanExecutor's."""

    def __init__(self, path, gguf, config, parts: tuple[Span, ...], plan: tuple):
        self.parts = parts
        self.head = parts[-1].head
        self.servers = list(dict.fromkeys(endpoint(p.backend) for p in parts))
        self._setup = {"path": str(path), "parts": parts, "plan": plan}
        num_blocks, _, kv_dtype, max_tokens, max_logit_rows = plan
        self._need = {  # endpoint -> {what: bytes} of its parts
            ep: total_bytes(
                SpanExecutor.planned_bytes(
                    gguf, config, p, num_blocks, kv_dtype, max_tokens, max_logit_rows, False
                )
                for p in parts
                if endpoint(p.backend) == ep
            )
            for ep in self.servers
        }
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._log = None
        self._unanswered = False  # a step was sent and its answer not read
        self.reports: list[str] = []
        self.device_bytes: dict[str, int] = {}
        self.num_steps = 0
        self._start()

    # -- the worker -----------------------------------------------------------------------

    def _start(self) -> None:
        """Probe every server (one clear error), then start a worker and wait for its spans."""
        for ep in self.servers:
            where = ", ".join(p.describe() for p in self.parts if endpoint(p.backend) == ep)
            check_fits(probe(ep), where, self._need[ep])
        ours, theirs = socketpair()
        self._conn = Connection(ours.detach())
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ, GGML_NO_BACKTRACE="1")  # an abort is expected, and quoted
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "edgeinfer.ggml.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=self._log,
                env=env,
            )
            theirs.close()
            try:
                self._conn.send(self._setup)
            except OSError:  # it died at once: its output says why
                pass
            reply = self._reply(LOAD_TIMEOUT_S)
            if reply is None or reply[0] == "error":
                detail = reply[1] if reply else self._tail() or "it exited"
                raise RPCError(f"the ggml RPC spans could not load: {detail}")
        except BaseException:
            theirs.close()
            self._stop()
            raise
        _, self.reports, self.device_bytes = reply

    def _reply(self, timeout: float):
        """The worker's next message, or None once it is gone (killed after `timeout`)."""
        try:
            if self._conn.poll(timeout):
                return self._conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def _tail(self) -> str:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            self._proc.wait()
        self._log.seek(0)
        text = self._log.read().decode(errors="replace").strip()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        return re.sub(r"^\S*/", "", last)[-ERROR_TAIL:]  # (a source file's path: its name)

    def _stop(self) -> None:
        """Close the connection (the worker frees its spans and exits) and reap the worker."""
        self._unanswered = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _lost(self, why: str) -> DeviceLostError:
        detail = self._tail() or why
        self._stop()
        gone = []
        for ep in self.servers:
            try:
                probe(ep, timeout=1.0)
            except RPCError as e:
                gone.append(str(e))
        culprit = "; ".join(gone) if gone else f"one of {', '.join(self.servers)}"
        return DeviceLostError(
            f"a ggml RPC server was lost mid-request ({culprit}); the requests using its layers "
            f"failed and their KV blocks were freed; the next request reconnects (ggml: {detail})"
        )

    # -- a step ---------------------------------------------------------------------------

    def __call__(self, x: np.ndarray, batch) -> np.ndarray:
        """As SpanExecutor.__call__, over every part in turn."""
        if self._conn is None:  # lost in an earlier step: reconnect (and upload) first
            self._start()
        if self._unanswered:  # a step the caller left (Ctrl-C): its answer comes first
            self._answer()
        try:
            self._conn.send((x, {f: getattr(batch, f) for f in BATCH_FIELDS}))
        except OSError:
            raise self._lost("the worker is gone") from None
        self._unanswered = True
        kind, out = self._answer()
        if kind == "error":
            raise GGMLError(out)
        self.num_steps += 1
        return out

    def _answer(self) -> tuple:
        reply = self._reply(STEP_TIMEOUT_S)
        if reply is None:
            raise self._lost(f"no answer within {STEP_TIMEOUT_S:g} s")
        self._unanswered = False
        return reply

    def make_batch_invariant(self) -> None:
        self.close()
        raise GGMLError(
            "batch-invariant mode cannot run layers on a ggml RPC server: only ggml's local CPU "
            "backend guarantees the same bits whatever the batch (leave batch invariance off)"
        )

    def report(self) -> str:
        return "; ".join(self.reports)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def close(self) -> None:
        self._stop()
