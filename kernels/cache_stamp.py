"""Keeps Numba's disk cache of the kernels true to all of their sources.

Numba checks a cached kernel against the timestamp of the file that defines it, and no other: a
unit's kernel inlines code from simd.py, kquant_dot.py, block_matmul.py ..., and a change there
alone (a `git pull` into an editable install) would leave the old compiled kernel in use. So at
import, a hash of every kernel source is compared with the one recorded beside the cache; when
they differ, the cached kernels are removed and Numba compiles them again.

The hash is of the code alone (its syntax tree without docstrings): a reworded comment or
docstring leaves every other file's kernels cached (Numba's own timestamp check still recompiles
the kernels of the file edited). Parsing every source costs more than the rest of the import, so
the files' sizes and timestamps are recorded too: while they stay the same, nothing is parsed.

Only the in-tree cache (`__pycache__` next to the sources, Numba's default) is checked: where it
is not writable Numba caches elsewhere, and an install that cannot be written to is replaced
whole, every file newer than its cache.

Beside the kernels, the cache keeps answers that take LLVM a while to give (`remembered`): they
are dropped with the kernels, when the code changes.
"""

import ast
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

STAMP = "kernel-sources.sha256"


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            del body[0]
    return tree


def code_of(source: bytes) -> bytes:
    """A Python file's code, without comments, docstrings or layout (its source as it is where
    it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return source
    return ast.dump(_without_docstrings(tree)).encode()


def _sources(package_dir: Path) -> list[Path]:
    return sorted(package_dir.glob("*.py"))


def sources_digest(package_dir: Path) -> str:
    h = hashlib.sha256()
    for path in _sources(package_dir):
        h.update(path.name.encode() + b"\0" + code_of(path.read_bytes()) + b"\0")
    return h.hexdigest()


def _files(package_dir: Path) -> tuple[str, int]:
    # -> (a hash of the sources' names, sizes and timestamps, the newest timestamp)
    h, newest = hashlib.sha256(), 0
    for path in _sources(package_dir):
        st = path.stat()
        h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        newest = max(newest, st.st_mtime_ns)
    return h.hexdigest(), newest


def refresh(package_dir: Path) -> bool:
    """Drop package_dir's cached kernels if its code changed since they were recorded
    (or was never recorded); True when it dropped them."""
    cache = package_dir / "__pycache__"
    stamp = cache / STAMP
    files, newest = _files(package_dir)
    try:
        recorded = stamp.read_text().split()
        # a file written in the clock tick the stamp was (timestamps are coarse) may have
        # changed after it: only an older one is trusted on its timestamp (git's "racy" rule)
        trusted = newest < stamp.stat().st_mtime_ns
    except OSError:
        recorded, trusted = [], False
    if trusted and recorded[1:] == [files]:
        return False
    digest = sources_digest(package_dir)
    dropped = recorded[:1] != [digest]
    try:
        if dropped:
            for entry in (*cache.glob("*.nbi"), *cache.glob("*.nbc"), *cache.glob("*.answer")):
                entry.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(f"{digest}\n{files}\n")
    except OSError:
        return False  # not writable: Numba keeps its cache elsewhere
    return dropped


def remembered(package_dir: Path, name: str, key: str, ask: Callable[[], bool]) -> bool:
    """ask(), kept in package_dir's cache as `name` while key (what the answer depends on
    besides the code: the compile target, LLVM's version) stays the same."""
    path = package_dir / "__pycache__" / f"{name}.answer"
    try:
        recorded_key, answer = path.read_text().rsplit("\n", 1)
        if recorded_key == key and answer in ("0", "1"):
            return answer == "1"
    except (OSError, ValueError):
        pass
    result = ask()
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    try:  # by rename: a process reading it at the same time sees the old answer or the new
        partial.write_text(f"{key}\n{int(result)}")
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)  # not writable: asked again next time
    return result
