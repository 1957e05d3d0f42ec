"""Incremental detokenization for streaming generated text."""

from __future__ import annotations

import codecs


class StreamDecoder:
    """Turns token ids into text as they arrive. `push` never returns part of a UTF-8
    character: bytes of an unfinished one wait for the next token. All pushes followed by
    `flush` concatenate to `Tokenizer.decode` of the same ids."""

    def __init__(self, pieces: list[bytes], bos_id: int | None):
        self._pieces = pieces
        self._bos_id = bos_id
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._started = False
        self._strip_space = False  # decode drops one leading space after a leading BOS

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(f"token id {token_id} outside the vocabulary")
        piece = self._pieces[token_id]
        if not self._started:
            self._started = True
            self._strip_space = token_id == self._bos_id
        if self._strip_space and piece:
            self._strip_space = False
            if piece[:1] == b" ":
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """What is left at the end of the stream: an unfinished character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)
