"""edgeinfer.models: one module per `general.architecture`, over a shared base (`base.py`).

Adding an architecture: a module named after it with a `DecoderModel` subclass, and one entry
in ARCHITECTURES; ModelConfig accepts exactly these architectures. Nothing here imports the
kernels until a model loads, so validating a file stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeinfer.ggml.placement import Span
    from edgeinfer.gguf.model_config import ModelConfig
    from edgeinfer.gguf.reader import GGUFFile

    from .base import DecoderModel

# general.architecture -> the class in the module of that name
ARCHITECTURES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3": "Gemma3"}


def load_model(g: GGUFFile, config: ModelConfig, offload: Span | None = None) -> DecoderModel:
    """The model for config.arch with its weights from g (kept memory-mapped where possible);
    the layers of `offload` are left to a ggml span executor (DecoderModel.attach)."""
    module = import_module(f"{__name__}.{config.arch}")
    return getattr(module, ARCHITECTURES[config.arch])(g, config, offload)


__all__ = ["ARCHITECTURES", "load_model"]
