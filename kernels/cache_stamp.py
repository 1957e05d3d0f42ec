"""Keeps Numba's disk cache of the kernels true to all of their sources.

Numba checks a cached kernel against the timestamp of the file that defines it, and no other: a
unit's kernel inlines code from simd.py, kquant_dot.py, block_matmul.py ..., and a change there
alone (a `git pull` into an editable install) would leave the old compiled kernel in use. So at
import, a hash of every kernel source is compared with the one recorded beside the cache; when
they differ, the cached kernels are removed and Numba compiles them again.

Only the in-tree cache (`__pycache__` next to the sources, Numba's default) is checked: where it
is not writable Numba caches elsewhere, and an install that cannot be written to is replaced
whole, every file newer than its cache.
"""

import hashlib
from pathlib import Path

STAMP = "kernel-sources.sha256"


def sources_digest(package_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(package_dir.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def refresh(package_dir: Path) -> bool:
    """Drop package_dir's cached kernels if its sources changed since they were recorded
    (or were never recorded); True when it dropped them."""
    cache = package_dir / "__pycache__"
    stamp = cache / STAMP
    digest = sources_digest(package_dir)
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        for entry in (*cache.glob("*.nbi"), *cache.glob("*.nbc")):
            entry.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        return False  # not writable: Numba keeps its cache elsewhere
    return True
