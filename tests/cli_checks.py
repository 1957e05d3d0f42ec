"""The `edgeinfer` command run as a user runs it, and the one-line error it must give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXE = Path(sys.executable).with_name("edgeinfer")


def edgeinfer(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=timeout)


def one_error_line(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2 and a single `error: ...` line on stderr naming every needle."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
