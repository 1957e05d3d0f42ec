"""Imports Numba without PyYAML where Numba has no use for it.

Numba's config imports PyYAML (12-16 ms of a start) for one purpose: reading a
`.numba_config.yaml` in the current directory. Where there is none, and nothing has imported
PyYAML yet, Numba is imported with PyYAML hidden (its own fallback for a missing PyYAML), then
PyYAML is importable again as before.
"""

import sys
from pathlib import Path

NUMBA_CONFIG_FILE = ".numba_config.yaml"  # numba.core.config._config_fname


def import_numba() -> None:
    if "numba" in sys.modules or "yaml" in sys.modules or Path(NUMBA_CONFIG_FILE).exists():
        import numba  # noqa: F401

        return
    sys.modules["yaml"] = None  # the import system's "not installed"
    try:
        import numba  # noqa: F401
    finally:
        del sys.modules["yaml"]
