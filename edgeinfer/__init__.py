"""edgeinfer: a CPU-first LLM inference runtime for GGUF model files."""

from importlib import import_module

from edgeinfer.errors import EdgeInferError, GGUFError, ModelNotFoundError, PullError

# The API classes load on first use so that `import edgeinfer` (every CLI start) stays cheap.
_LAZY = {
    "LLM": "edgeinfer.llm",
    "Completion": "edgeinfer.engine.outputs",
    "SamplingParams": "edgeinfer.engine.sampling",
    "AsyncEngine": "edgeinfer.async_engine",
    "RequestOutput": "edgeinfer.async_engine",
    "EngineStats": "edgeinfer.engine.engine",
}

__all__ = ["EdgeInferError", "GGUFError", "ModelNotFoundError", "PullError", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'edgeinfer' has no attribute {name!r}")
