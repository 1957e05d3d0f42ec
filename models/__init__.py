"""edgeinfer.models: one module per `general.architecture`, a shared base, and the registry.

Adding an architecture: a new module with a `DecoderModel` subclass and one entry in
ARCHITECTURES (plus ModelConfig's list of supported architectures).
"""

from edgeinfer.gguf.reader import GGUFFile
from edgeinfer.gguf.model_config import ModelConfig

from .base import Batch, DecoderModel
from .gemma3 import Gemma3
from .llama import Llama
from .qwen2 import Qwen2
from .qwen3 import Qwen3

ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "llama": Llama,
    "qwen2": Qwen2,
    "qwen3": Qwen3,
    "gemma3": Gemma3,
}


def load_model(g: GGUFFile, config: ModelConfig) -> DecoderModel:
    """The model for config.arch with its weights from g (kept memory-mapped where possible).

    ModelConfig.from_gguf has already refused architectures outside SUPPORTED_ARCHS."""
    return ARCHITECTURES[config.arch](g, config)


__all__ = ["ARCHITECTURES", "Batch", "DecoderModel", "load_model"]
