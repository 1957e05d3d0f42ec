"""What edgeinfer supports is listed once; these check that the code behind each list exists."""

from pathlib import Path

import pytest

from edgeinfer import kernels
from edgeinfer.gguf.tensor_types import KERNEL_FAMILIES
from edgeinfer.models import ARCHITECTURES


def test_every_supported_architecture_has_a_model_file():
    import importlib

    from edgeinfer.models.base import DecoderModel

    for arch, name in ARCHITECTURES.items():
        cls = getattr(importlib.import_module(f"edgeinfer.models.{arch}"), name)
        assert issubclass(cls, DecoderModel)


def test_every_supported_tensor_type_has_a_unit_in_its_family_module():
    # get_unit imports the type's family module and raises if that module built no such unit
    for qtype in KERNEL_FAMILIES:
        assert kernels.get_unit(qtype).qtype == qtype


def test_every_subpackage_is_in_the_distribution():
    # an editable install imports a package left out of pyproject's list; a wheel does not
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).parent.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {"edgeinfer." + p.parent.name for p in (root / "edgeinfer").glob("*/__init__.py")}
    assert found <= listed, f"missing from pyproject.toml's packages: {sorted(found - listed)}"
