"""The tokenizer of a GGUF model: text <-> token ids exactly as llama.cpp does it."""

from __future__ import annotations

import os
from collections.abc import Iterable

from edgeinfer.gguf.reader import GGUFFile, read_gguf
from edgeinfer.tokenizer.bpe import CHAR_TO_BYTE, BPEModel
from edgeinfer.tokenizer.cache import cached
from edgeinfer.tokenizer.special import SpecialSplitter
from edgeinfer.tokenizer.spm import SPMModel
from edgeinfer.tokenizer.stream import StreamDecoder
from edgeinfer.tokenizer.vocab import BYTE, CONTROL, NORMAL, SPM, UNKNOWN, USER_DEFINED, Vocab


class Tokenizer:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._special = SpecialSplitter(vocab)
        self._model = SPMModel(vocab) if vocab.kind == SPM else BPEModel(vocab)
        # What each token renders as, without and with control/unknown tokens shown.
        self._pieces = cached(
            vocab.path, "pieces", lambda: _pieces(vocab),
            lambda p: isinstance(p, list) and len(p) == len(vocab.tokens),
        )  # fmt: skip
        self._pieces_special = list(self._pieces)
        for i in vocab.special_ids:  # the control and unknown tokens are among them
            if vocab.attrs[i] & (UNKNOWN | CONTROL):
                self._pieces_special[i] = vocab.tokens[i].encode()

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | GGUFFile) -> Tokenizer:
        g = source if isinstance(source, GGUFFile) else read_gguf(source)
        return cls(Vocab.from_metadata(g.metadata, g.path))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eos_ids(self) -> set[int]:
        """Every token that ends generation (EOS, end-of-turn, ...), as llama.cpp's EOG set."""
        return set(self.vocab.eog_ids)

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of `text`. add_bos: None = the model's rule (BOS and EOS as its metadata
        says), True = BOS first (and EOS if the model adds one), False = neither.
        special: parse control-token texts such as "<|im_start|>" into their ids; user-defined
        tokens are always split out, as in llama.cpp."""
        vocab = self.vocab
        bos = vocab.add_bos if add_bos is None else add_bos
        eos = vocab.add_eos and add_bos is not False
        if bos and vocab.bos_id is None:
            raise ValueError("this model has no BOS token")
        text = _encodable(text)
        out: list[int] = [vocab.bos_id] if bos else []
        model, spm = self._model, vocab.kind == SPM
        after_special = True
        for frag in self._special.split(text, special):
            if isinstance(frag, int):
                out.append(frag)
                after_special = True
            elif spm:
                model.encode(frag, out, after_special)
                after_special = False
            else:
                model.encode(frag, out)
        if eos and vocab.eos_id is not None:
            out.append(vocab.eos_id)
        return out

    def clear_cache(self) -> None:
        """Forget memoized word encodings (they only speed up repeated words)."""
        self._model.clear_cache()

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of `ids` as llama.cpp renders them (llama-cpp-python's Llama.detokenize):
        pieces concatenated, one leading space dropped after a leading BOS, control tokens
        hidden unless `special`. Invalid UTF-8 becomes U+FFFD."""
        ids = list(ids)
        return self._bytes(ids, special).decode("utf-8", "replace")

    def _bytes(self, ids: list[int], special: bool) -> bytes:
        pieces = self._pieces_special if special else self._pieces
        n = len(pieces)
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} outside the vocabulary (size {n})")
        data = b"".join([pieces[i] for i in ids])
        if ids and ids[0] == self.bos_id and data[:1] == b" ":
            data = data[1:]
        return data

    def token_to_piece(self, token_id: int, special: bool = False) -> str:
        """One token's text; a byte token that is part of a character gives U+FFFD."""
        return self._bytes_of(token_id, special).decode("utf-8", "replace")

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """One token's raw bytes (llama_token_to_piece)."""
        return self._bytes_of(token_id, special)

    def _bytes_of(self, token_id: int, special: bool) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary (size {self.vocab_size})")
        return (self._pieces_special if special else self._pieces)[token_id]

    def stream_decoder(self, special: bool = False) -> StreamDecoder:
        return StreamDecoder(self._pieces_special if special else self._pieces, self.bos_id)


# GPT-2 alphabet character -> the byte it stands for, as a Latin-1 character; Latin-1
# characters outside the alphabet map beyond Latin-1 so they take the slow path.
_GPT2_TO_LATIN1 = {
    **{c: "\uffff" for c in range(256)},
    **{ord(c): b for c, b in CHAR_TO_BYTE.items()},
}


def _encodable(text: str) -> str:
    # Lone surrogates cannot be UTF-8; they become U+FFFD, as invalid input does in llama.cpp.
    try:
        text.encode()
    except UnicodeEncodeError:
        return "".join("\ufffd" if 0xD800 <= ord(c) < 0xE000 else c for c in text)
    return text


def _pieces(vocab: Vocab) -> list[bytes]:
    """llama.cpp's llama_token_to_piece(token, lstrip=0, special=False) of every token."""
    if vocab.kind == SPM:
        pieces = [t.replace("\u2581", " ").encode() for t in vocab.tokens]
    else:
        pieces = [_gpt2_decode(t) for t in vocab.tokens]
    for i, attr in enumerate(vocab.attrs):
        if attr == NORMAL:
            continue
        text = vocab.tokens[i]
        if attr & (UNKNOWN | CONTROL):
            pieces[i] = b""
        elif attr & USER_DEFINED:
            pieces[i] = text.encode()
        elif attr & NORMAL:
            pass
        elif attr & BYTE:
            try:
                pieces[i] = bytes([int(text[3:5], 16)])
            except ValueError:
                pieces[i] = b"\x00"
        else:
            pieces[i] = b""
    return pieces


def _gpt2_decode(text: str) -> bytes:
    try:
        return text.translate(_GPT2_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        pass
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            # llama.cpp's marker for a character outside GPT-2's byte alphabet.
            out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text.encode() + b"]"
    return bytes(out)
