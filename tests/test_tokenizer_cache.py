"""The tokenizer's tables kept on disk between runs: a second load reads them and tokenizes as a
fresh build does; a damaged file is rebuilt, a changed model file is not served stale tables,
and a cache that cannot be written costs nothing but the time."""

import marshal
import os
import shutil

import pytest

from edgeinfer.tokenizer import bpe, spm
from edgeinfer.tokenizer import tokenizer as tokenizer_module
from edgeinfer.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces, tabs\tand\nnewlines \u00e9\u00e8 \u4f60\u597d \U0001f600",
    "def f(x):\n    return x ** 2  # 12345.678",
    "<|im_start|>user\nHi<|im_end|> <start_of_turn>model\n<end_of_turn>",
]
BUILDERS = {"bpe": (bpe, "_tables"), "spm": (spm, "_model_proto")}


@pytest.fixture(params=["smollm2-135m-instruct", "gemma3-270m"])
def model(request, real_model, tmp_path, monkeypatch):
    """(a copy of the real model's file, its tokenizer model's table name), with an empty
    $EDGEINFER_HOME."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(real_model(request.param), path)
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    return path, "bpe" if request.param.startswith("smollm2") else "spm"


def encodings(tok: Tokenizer) -> list:
    out = []
    for text in TEXTS:
        for special in (False, True):
            ids = tok.encode(text, special=special)
            out.append((ids, tok.decode(ids)))
    return out


def count_builds(monkeypatch, table: str) -> list[str]:
    """Record each call of the builders of the tokenizer model's table and of the pieces."""
    calls: list[str] = []
    for name, (module, attr) in (("pieces", (tokenizer_module, "_pieces")),
                                 (table, BUILDERS[table])):  # fmt: skip
        real = getattr(module, attr)

        def spy(*args, real=real, name=name):
            calls.append(name)
            return real(*args)

        monkeypatch.setattr(module, attr, spy)
    return calls


def cache_files(tmp_path) -> list:
    return sorted(p.name.rsplit(".", 1)[1] for p in (tmp_path / "home" / "tokenizers").iterdir())


def test_a_second_load_reads_the_tables_and_tokenizes_the_same(model, monkeypatch, tmp_path):
    path, table = model
    calls = count_builds(monkeypatch, table)
    fresh = encodings(Tokenizer.from_gguf(path))
    assert sorted(calls) == sorted(["pieces", table])
    assert cache_files(tmp_path) == sorted(["pieces", table])
    calls.clear()
    assert encodings(Tokenizer.from_gguf(path)) == fresh
    assert calls == []  # both tables came from the files


def test_a_damaged_file_is_rebuilt(model, monkeypatch, tmp_path):
    path, table = model
    fresh = encodings(Tokenizer.from_gguf(path))
    files = sorted((tmp_path / "home" / "tokenizers").iterdir())
    whole = {f: f.read_bytes() for f in files}
    files[0].write_bytes(whole[files[0]][: len(whole[files[0]]) // 2])  # cut short
    files[1].write_bytes(marshal.dumps(["a valid file of the wrong shape"]))
    calls = count_builds(monkeypatch, table)
    assert encodings(Tokenizer.from_gguf(path)) == fresh
    assert sorted(calls) == sorted(["pieces", table])
    assert {f: f.read_bytes() for f in files} == whole  # rewritten whole


def test_a_changed_model_file_gets_new_tables_and_the_stale_ones_go(model, monkeypatch, tmp_path):
    path, table = model
    fresh = encodings(Tokenizer.from_gguf(path))
    before = set((tmp_path / "home" / "tokenizers").iterdir())
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a re-download would
    calls = count_builds(monkeypatch, table)
    assert encodings(Tokenizer.from_gguf(path)) == fresh
    assert sorted(calls) == sorted(["pieces", table])
    after = set((tmp_path / "home" / "tokenizers").iterdir())
    assert len(after) == 2 and not after & before


def test_a_cache_that_cannot_be_written_only_costs_time(model, monkeypatch, tmp_path):
    path, table = model
    fresh = encodings(Tokenizer.from_gguf(path))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("EDGEINFER_HOME", str(blocker))
    calls = count_builds(monkeypatch, table)
    assert encodings(Tokenizer.from_gguf(path)) == fresh
    assert sorted(calls) == sorted(["pieces", table])
    assert blocker.read_text().startswith("a file") and list(tmp_path.glob("**/*.part")) == []
