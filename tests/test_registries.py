"""Lists of what edgeinfer supports live where each layer needs them; these keep them in step."""

from edgeinfer import kernels
from edgeinfer.gguf.reader import SUPPORTED_TENSOR_TYPES
from edgeinfer.models import ARCHITECTURES


def test_every_supported_architecture_has_a_model_file():
    import importlib

    from edgeinfer.models.base import DecoderModel

    for arch, name in ARCHITECTURES.items():
        cls = getattr(importlib.import_module(f"edgeinfer.models.{arch}"), name)
        assert issubclass(cls, DecoderModel)


def test_the_reader_accepts_exactly_the_tensor_types_the_kernels_implement():
    assert set(SUPPORTED_TENSOR_TYPES) == set(kernels.supported_types())
