"""edgeinfer: a CPU-first LLM inference runtime for GGUF model files."""

from edgeinfer.errors import EdgeInferError, GGUFError, ModelNotFoundError, PullError

__all__ = ["EdgeInferError", "GGUFError", "ModelNotFoundError", "PullError"]
__version__ = "0.1.0"
