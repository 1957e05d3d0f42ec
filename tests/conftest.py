"""Session fixtures shared by every test file: synthetic and real model files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import synthetic

from edgeinfer.gguf import hub


@pytest.fixture(scope="session")
def synthetic_model() -> Callable[[str, str], Path]:
    """synthetic_model(arch, ftype) -> path of a tiny random model (built once, cached on disk).

    arch in synthetic.ARCHS, ftype in synthetic.FTYPES.
    """
    return synthetic.model_path


@pytest.fixture(scope="session")
def real_model() -> Callable[[str], Path]:
    """real_model(name) -> path of a pulled real model ('smollm2-135m-instruct', 'gemma3-270m')."""
    return hub.resolve_model
