"""llama.cpp (llama-cpp-python) as the tokenizer oracle, and the vocabulary fixtures of
llama.cpp's own test suite (tests/data/vocab): shared by the tokenizer and template tests."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from edgeinfer.tokenizer import Tokenizer

VOCAB_DIR = Path(__file__).parent / "data" / "vocab"
VOCABS = ("llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2")


def vocab_path(name: str) -> Path:
    return VOCAB_DIR / f"ggml-vocab-{name}.gguf"


@cache
def ours(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path)


class Oracle:
    """llama.cpp's tokenizer through the C API (no buffer-size limits of the Python helpers)."""

    def __init__(self, path: str):
        import llama_cpp  # here, not at the top: make test-arm imports this module without it

        self.api = llama_cpp
        self.llama = llama_cpp.Llama(path, vocab_only=True, verbose=False)
        self.vocab = self.api.llama_model_get_vocab(self.llama._model.model)
        self.n_tokens = self.api.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode()
        cap = len(data) + 8
        buf = (self.api.llama_token * cap)()
        n = self.api.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special,
                                    parse_special)  # fmt: skip
        assert n >= 0
        return buf[:n]

    def piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(1024)
        n = self.api.llama_token_to_piece(self.vocab, token, buf, 1024, 0, special)
        assert 0 <= n <= 1024
        return buf.raw[:n]

    def detokenize(self, ids: list[int], special: bool = False) -> str:
        # llama-cpp-python's Llama.detokenize: pieces joined, a leading space dropped after BOS.
        data = b"".join(self.piece(i, special) for i in ids)
        bos = self.api.llama_vocab_bos(self.vocab)
        if ids and ids[0] == bos and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")


@cache
def oracle(path: str) -> Oracle:
    return Oracle(path)


def reference_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, HF reference ids without BOS) from llama.cpp's test files."""
    sep = "\n__ggml_vocab_test__\n"
    texts = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(sep)
    lines = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert texts[-1] == "" and lines[-1] == ""
    pairs = zip(texts[:-1], lines[:-1], strict=True)
    cases = [(t, [int(x) for x in line.split()]) for t, line in pairs]
    assert len(cases) == len(texts) - 1 == len(lines) - 1
    return cases
