"""ModelRunner: a loaded model plus its paged KV cache; turns (sequence, tokens) into logits.

It owns the translation from sequences to arrays (token ids, positions, slot mapping, block
tables) so that models never compute block ids, and it checks every request before any state
changes: a bad token id or a request past the context raises and leaves the cache as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import psutil

from edgeinfer import kernels
from edgeinfer.block_manager import KVCacheFullError
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf_reader import read_gguf
from edgeinfer.kv_cache import BLOCK_SIZE, KV_DTYPES, KVCache
from edgeinfer.memory_plan import DEFAULT_CTX, PREFILL_CHUNK, kv_bytes
from edgeinfer.model_config import ModelConfig
from edgeinfer.models import Batch, load_model


class ContextLengthError(EdgeInferError):
    """A sequence would grow past the runner's context length."""


class TokenIdError(EdgeInferError):
    """A token id outside the model's vocabulary (or not an integer)."""


class ModelRunner:
    """forward(seq_id, token_ids) appends tokens to a sequence's KV cache and returns logits.

    ctx: the longest sequence (default: the model's context length, at most DEFAULT_CTX);
    the KV cache holds max_seqs sequences of ctx tokens; kv_dtype: "f16" (default) or "f32".
    """

    def __init__(
        self,
        path_or_name: str | Path,
        threads: int | None = None,
        ctx: int | None = None,
        kv_dtype: str = "f16",
        max_seqs: int = 1,
    ):
        from edgeinfer.hub import resolve_model

        if kv_dtype not in KV_DTYPES:
            raise EdgeInferError(
                f"kv dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}"
            )
        if ctx is not None and ctx < 1:
            raise EdgeInferError(f"context length must be at least 1, got {ctx}")
        if max_seqs < 1:
            raise EdgeInferError(f"max_seqs must be at least 1, got {max_seqs}")
        self.path = resolve_model(str(path_or_name))
        self.threads = kernels.set_threads(threads)
        self.gguf = read_gguf(self.path)
        self.config = ModelConfig.from_gguf(self.gguf)
        self.model = load_model(self.gguf, self.config)
        self._max_context = ctx if ctx is not None else min(self.config.ctx_len, DEFAULT_CTX)
        self._check_kv_budget(max_seqs, kv_dtype)
        blocks_per_seq = math.ceil(self._max_context / BLOCK_SIZE)
        self.kv = KVCache.for_model(self.config, max_seqs * blocks_per_seq, kv_dtype)

    def _check_kv_budget(self, max_seqs: int, kv_dtype: str) -> None:
        """Refuse a KV cache larger than the RAM available now, before allocating it (np.zeros
        would succeed lazily and the process would be killed later, mid-reply)."""
        need = kv_bytes(self.config, self._max_context, max_seqs, kv_dtype)
        available = psutil.virtual_memory().available
        if need > available:
            raise EdgeInferError(
                f"a {kv_dtype} KV cache for {max_seqs} x {self._max_context} tokens needs "
                f"{need / 2**30:.1f} GiB but {available / 2**30:.1f} GiB of RAM is available; "
                "use a smaller --ctx (`edgeinfer info MODEL` shows the largest that fits)"
            )

    @cached_property
    def tokenizer(self):
        from edgeinfer.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.gguf)

    @cached_property
    def chat_template(self):
        from edgeinfer.chat_template import ChatTemplate

        return ChatTemplate.from_gguf(self.gguf)

    @property
    def max_context(self) -> int:
        return self._max_context

    def seq_len(self, seq_id: int) -> int:
        return self.kv.blocks.seq_len(seq_id)

    def free(self, seq_id: int) -> None:
        self.kv.blocks.free(seq_id)

    def forward(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        """token_ids: [n] -> float32[n, vocab], the logits after each new position."""
        ids = self._check(seq_id, token_ids)
        chunks = [
            self._run([(seq_id, ids[i : i + PREFILL_CHUNK])], all_logits=True)[0]
            for i in range(0, len(ids), PREFILL_CHUNK)
        ]
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def forward_last(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        """token_ids: [n] -> float32[vocab], the logits after the last one."""
        ids = self._check(seq_id, token_ids)
        for i in range(0, len(ids), PREFILL_CHUNK):
            logits = self._run([(seq_id, ids[i : i + PREFILL_CHUNK])], all_logits=False)
        return logits[0][0]

    def forward_batch(
        self, requests: Sequence[tuple[int, Sequence[int]]], all_logits: bool = False
    ) -> list[np.ndarray]:
        """Several sequences in one pass (each seq_id once): [(seq_id, token_ids), ...] ->
        per request float32[n_i, vocab] (all_logits) or float32[1, vocab] (last position)."""
        seen = set()
        checked = []
        for seq_id, token_ids in requests:
            if seq_id in seen:
                raise EdgeInferError(f"sequence {seq_id} appears twice in one batch")
            seen.add(seq_id)
            checked.append((seq_id, self._check(seq_id, token_ids)))
        return self._run(checked, all_logits)

    def _check(self, seq_id: int, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise TokenIdError(f"expected a non-empty list of token ids, got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TokenIdError(f"token ids must be integers, got {ids.dtype}")
        vocab = self.config.vocab_size
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            raise TokenIdError(f"token id {ids[bad][0]} is out of range [0, {vocab})")
        have = self.seq_len(seq_id)
        if have + ids.size > self._max_context:
            raise ContextLengthError(
                f"sequence {seq_id}: {have} + {ids.size} tokens exceed the context length "
                f"{self._max_context}"
            )
        return ids.astype(np.int32)

    def _run(self, requests: list[tuple[int, np.ndarray]], all_logits: bool) -> list[np.ndarray]:
        blocks = self.kv.blocks
        need = sum(blocks.blocks_needed(s, ids.size) for s, ids in requests)
        if need > blocks.num_free_blocks:
            raise KVCacheFullError(
                f"KV cache full: {need} blocks needed, {blocks.num_free_blocks} free "
                f"({blocks.num_blocks} blocks of {blocks.block_size} tokens)"
            )
        sizes = [ids.size for _, ids in requests]
        starts = [blocks.seq_len(s) for s, _ in requests]
        slots = [blocks.append(s, ids.size) for s, ids in requests]
        ends = np.cumsum(sizes)
        batch = Batch(
            token_ids=np.concatenate([ids for _, ids in requests]),
            positions=np.concatenate(
                [np.arange(p, p + k, dtype=np.int32) for p, k in zip(starts, sizes, strict=True)]
            ),
            seq_rows=np.repeat(np.arange(len(requests), dtype=np.int32), sizes),
            slots=np.array([x for s in slots for x in s], np.int64),
            block_tables=self.kv.block_tables([s for s, _ in requests]),
            logit_rows=None if all_logits else (ends - 1).astype(np.int64),
        )
        logits = self.model.forward(batch, self.kv.k, self.kv.v)
        if all_logits:
            return np.split(logits, ends[:-1])
        return [logits[i : i + 1] for i in range(len(requests))]
