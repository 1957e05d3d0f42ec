"""Tokenizers and chat templates built from GGUF metadata alone."""

from edgeinfer.tokenizer.stream import StreamDecoder
from edgeinfer.tokenizer.tokenizer import Tokenizer

__all__ = ["StreamDecoder", "Tokenizer"]
