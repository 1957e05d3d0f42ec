"""Numba is imported without PyYAML where no `.numba_config.yaml` needs it, and still reads one
that is there; PyYAML stays importable either way. Fresh interpreters: Numba imports once."""

import subprocess
import sys

_SCRIPT = """
import sys
import edgeinfer.kernels
from numba.core import config
off = config.DISABLE_PERFORMANCE_WARNINGS
print("yaml imported:", "yaml" in sys.modules, "performance warnings off:", off)
import yaml
print("yaml importable:", yaml.safe_load("a: 1") == {"a": 1})
"""


def _run(cwd) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_numba_skips_pyyaml_without_a_config_file(tmp_path):
    assert _run(tmp_path) == [
        "yaml imported: False performance warnings off: 0",
        "yaml importable: True",
    ]


def test_a_config_file_is_still_read(tmp_path):
    (tmp_path / ".numba_config.yaml").write_text("disable_performance_warnings: 1\n")
    assert _run(tmp_path) == [
        "yaml imported: True performance warnings off: 1",
        "yaml importable: True",
    ]
