"""SentencePiece vocabularies (`tokenizer.ggml.model = llama`) through the sentencepiece library.

The model proto is written in memory from the GGUF vocabulary (a few protobuf fields, encoded
here so protobuf itself is not needed). llama.cpp runs its own copy of SentencePiece's BPE
(highest score first, leftmost on ties, unknown pieces to byte tokens), which the library
matches when it is set up as llama.cpp behaves:

- every token that is not a byte or the unknown token is NORMAL in the proto: llama.cpp lets
  merges reach control, user-defined and unused tokens by their text, and the library would
  otherwise refuse control pieces, match user-defined ones greedily and re-split unused ones;
- the normalizer is the identity and the caller escapes spaces and adds the space prefix
  itself, because llama.cpp adds it per raw fragment (after every special token), not once.
"""

from __future__ import annotations

import numpy as np
import sentencepiece

from edgeinfer.errors import GGUFError
from edgeinfer.tokenizer.cache import cached
from edgeinfer.tokenizer.vocab import BYTE, UNKNOWN, Vocab

_NORMAL, _UNKNOWN, _BYTE = 1, 2, 6  # ModelProto.SentencePiece.Type
_BPE = 2  # TrainerSpec.ModelType


class SPMModel:
    def __init__(self, vocab: Vocab):
        self._add_space_prefix = vocab.add_space_prefix
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            proto = cached(vocab.path, "spm", lambda: _model_proto(vocab), _is_bytes)
            self._sp.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError) as e:
            raise GGUFError(vocab.path, f"SentencePiece vocabulary rejected: {e}") from None

    def clear_cache(self) -> None:
        pass  # SentencePiece keeps no state between calls

    def encode(self, text: str, out: list[int], after_special: bool) -> None:
        """Append the ids of a raw fragment; `after_special`: it starts the text or follows a
        special token, where llama.cpp inserts the space prefix."""
        if self._add_space_prefix and after_special:
            text = " " + text
        out += self._sp.EncodeAsIds(text.replace(" ", "\u2581"))


def _is_bytes(value) -> bool:
    return isinstance(value, bytes)


def _model_proto(vocab: Vocab) -> bytes:
    unk = next((i for i, a in enumerate(vocab.attrs) if a & UNKNOWN), vocab.ids["unk"])
    if unk is None:
        raise GGUFError(vocab.path, "SentencePiece vocabulary without an unknown token")
    scores = np.asarray(vocab.scores, dtype="<f4").tobytes()
    kinds = [_NORMAL] * len(vocab.tokens)
    for i, attr in enumerate(vocab.attrs):
        if attr & BYTE:
            kinds[i] = _BYTE
    kinds[unk] = _UNKNOWN
    # SentencePiece { 1: piece, 2: score (float), 3: type }, repeated as ModelProto field 1;
    # written by hand (a 262k vocabulary is a hot loop).
    type_fields = {k: _varint_field(3, k) for k in (_NORMAL, _UNKNOWN, _BYTE)}
    pieces = []
    for i, text in enumerate(vocab.tokens):
        raw = text.encode()
        body = b"\n" + _varint(len(raw)) + raw + b"\x15" + scores[4 * i : 4 * i + 4]
        body += type_fields[kinds[i]]
        pieces.append(b"\n" + _varint(len(body)) + body)
    trainer = (
        _varint_field(3, _BPE)
        + _varint_field(35, int(_BYTE in kinds))
        + _varint_field(40, unk)
        + _varint_field(41, -1)
        + _varint_field(42, -1)
        + _varint_field(43, -1)
    )
    normalizer = (
        _bytes_field(1, b"identity")
        + _varint_field(3, 0)  # add_dummy_prefix
        + _varint_field(4, 0)  # remove_extra_whitespaces
        + _varint_field(5, 0)  # escape_whitespaces
    )
    return b"".join(pieces) + _bytes_field(2, trainer) + _bytes_field(3, normalizer)


_ONE_BYTE_VARINTS = [bytes([n]) for n in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _ONE_BYTE_VARINTS[n]
    n &= (1 << 64) - 1  # negative int32 values go on the wire as 10-byte two's complement
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _varint_field(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes_field(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(value)) + value
