"""Tokenizers and chat templates built from GGUF metadata alone."""
