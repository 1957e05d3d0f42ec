"""A model's tokenizer tables kept on disk between runs: most of a warm start-up otherwise.

Building them from a GGUF vocabulary is Python over every token and merge rule (about 0.15 s
for SmolLM2's 49k BPE merges, 0.5 s for Gemma 3's 262k SentencePiece pieces, on this machine
class). They depend only on the model file and on this package's code, so they are stored under
$EDGEINFER_HOME/tokenizers, keyed by the file's identity (resolved path, size, modification
time) and a digest of the package's sources and the Python version; writing one removes the
stale ones of the same file name. A value is marshalled
(plain bytes, strings, numbers, lists, tuples, dicts), written to a temporary name and renamed,
so a reader sees a whole file or none; one that cannot be read or fails its check is rebuilt
and rewritten, and a cache directory that cannot be written only costs the time.
"""

from __future__ import annotations

import glob
import hashlib
import marshal
import os
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@cache
def _code_digest() -> bytes:
    h = hashlib.sha256(repr((sys.version_info[:2], marshal.version)).encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        h.update(source.name.encode() + source.read_bytes())
    return h.digest()


def cache_file(model: Path, table: str) -> Path:
    from edgeinfer.gguf.hub import home

    st = os.stat(model)
    ident = repr((str(Path(model).resolve()), st.st_size, st.st_mtime_ns, table)).encode()
    key = hashlib.sha256(_code_digest() + ident).hexdigest()[:32]
    return home() / "tokenizers" / f"{Path(model).stem}-{key}.{table}"


def cached(model: Path | None, table: str, build: Callable[[], T], valid: Callable[[T], bool]) -> T:
    """The table `build()` makes for the model file at `model` (None: no file, build it)."""
    if model is None:
        return build()
    try:
        path = cache_file(model, table)
    except OSError:  # the model file is gone: nothing to key on
        return build()
    try:
        value = marshal.loads(path.read_bytes())
        if valid(value):
            return value
    except (OSError, EOFError, ValueError, TypeError):
        pass
    value = build()
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(marshal.dumps(value))
        os.replace(part, path)
        # tables of an earlier version of this file (or of this code) are stale now
        stem = path.name.rsplit("-", 1)[0]
        for old in path.parent.glob(f"{glob.escape(stem)}-*.{table}"):
            if old != path and old.name.rsplit("-", 1)[0] == stem:
                old.unlink(missing_ok=True)
    except (OSError, ValueError):
        try:
            part.unlink(missing_ok=True)
        except OSError:
            pass
    return value
