"""Saved reference log-probabilities in llama-perplexity's own file format, both ways: a file
written by `edgeinfer eval --save-logits` is a `llama-perplexity --kl-divergence-base`, and
the reverse.

Layout (little-endian): "_logits_", u32 n_ctx, i32 n_vocab, i32 n_chunk, i32 tokens
[n_chunk * n_ctx] (the text's tokens, before BOS replaces each window's first), then per
window its n_ctx - 1 - n_ctx/2 scored rows of nv = 2 * ceil(n_vocab / 2) + 4 uint16: two
float32 (scale, min_log_prob), then each token's log-probability as
min_log_prob + scale * u16, over the 16 nats below the top (lower ones are stored as that floor,
and KL against such a file leaves out log-probs <= -16, as llama.cpp's does).
A window of Gemma 3's 262k vocabulary takes 134 MB, so --chunks bounds the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.eval.stats import log_sum_exp

MAGIC = b"_logits_"
RANGE = 16.0  # nats below the top log-probability that are resolved


def row_width(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_rows(n_ctx: int) -> int:
    return n_ctx - 1 - n_ctx // 2


def encode(logits: np.ndarray) -> np.ndarray:
    """float32[m, V] logits -> uint16[m, nv] rows as llama.cpp writes them."""
    x = np.asarray(logits, dtype=np.float32)
    m, v = x.shape
    top = x.max(axis=1, keepdims=True)
    low = np.maximum(x.min(axis=1, keepdims=True), top - np.float32(RANGE))
    lse = (log_sum_exp(x)[:, None] - top).astype(np.float32)  # of x - top
    scale = (top - low) / np.float32(65535)
    out = np.zeros((m, row_width(v)), np.uint16)
    head = out[:, :4].view(np.float32)  # two float32 per row
    head[:, 0] = scale[:, 0]
    head[:, 1] = (low - top - lse)[:, 0]
    safe = np.where(scale > 0, scale, np.float32(1))
    # llama.cpp's nearest_int rounds half to even, as np.rint does
    q = np.rint((x - low) / safe)
    out[:, 4 : 4 + v] = np.where((x > low) & (scale > 0), q, 0).astype(np.uint16)
    return out


def decode(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """uint16[m, nv] -> float32[m, V] log-probabilities."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    return head[:, 1:2] + head[:, 0:1] * rows[:, 4 : 4 + n_vocab].astype(np.float32)


class LogitsWriter:
    """Writes the header and token ids at once, then one window at a time."""

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_vocab: int, tokens: np.ndarray):
        self.path = Path(path)
        n_chunk = len(tokens) // n_ctx
        self.n_vocab = n_vocab
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._f.write(MAGIC)
        self._f.write(np.array([n_ctx], "<u4").tobytes())
        self._f.write(np.array([n_vocab, n_chunk], "<i4").tobytes())
        self._f.write(np.asarray(tokens[: n_chunk * n_ctx], "<i4").tobytes())

    def write(self, scored_logits: np.ndarray) -> None:
        self._f.write(encode(scored_logits).tobytes())

    def close(self) -> None:
        self._f.close()


class LogitsReader:
    """A saved file, checked against its own size before anything is read."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(20)
        if len(head) < 20 or head[:8] != MAGIC:
            raise EdgeInferError(f"{self.path}: not a saved-logits file (no '_logits_' header)")
        self.n_ctx = int(np.frombuffer(head, "<u4", 1, 8)[0])
        self.n_vocab, self.n_chunk = (int(v) for v in np.frombuffer(head, "<i4", 2, 12))
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1:
            raise EdgeInferError(
                f"{self.path}: bad header (n_ctx {self.n_ctx}, vocab {self.n_vocab}, "
                f"chunks {self.n_chunk})"
            )
        self._tokens_at = 20
        self._rows_at = 20 + 4 * self.n_ctx * self.n_chunk
        self._window = scored_rows(self.n_ctx) * row_width(self.n_vocab)
        need = self._rows_at + 2 * self._window * self.n_chunk
        if size < need:
            raise EdgeInferError(
                f"{self.path}: truncated ({size} bytes; its header promises {need})"
            )
        self._data = np.memmap(self.path, np.uint8, mode="r")

    @property
    def tokens(self) -> np.ndarray:
        n = self.n_ctx * self.n_chunk
        return np.frombuffer(self._data, "<i4", n, self._tokens_at).astype(np.int64)

    def log_probs(self, chunk: int) -> np.ndarray:
        """Window `chunk`'s scored rows -> float32[rows, V] log-probabilities."""
        start = self._rows_at + 2 * self._window * chunk
        rows = np.frombuffer(self._data, "<u2", self._window, start)
        return decode(rows.reshape(scored_rows(self.n_ctx), -1), self.n_vocab)
