"""ModelRunner: a loaded model plus its paged KV cache; turns (sequence, tokens) into logits.

It owns the translation from sequences to arrays (token ids, positions, slot mapping, block
tables) so that models never compute block ids, and it checks every request before any state
changes: a bad token id or a request past the context raises and leaves the cache as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import psutil

from edgeinfer import kernels
from edgeinfer.engine.block_manager import KVCacheFullError
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.engine.kv_cache import BLOCK_SIZE, KV_DTYPES, KVCache
from edgeinfer.engine.memory_plan import (
    DEFAULT_CTX,
    PREFILL_CHUNK,
    kv_block_bytes,
    kv_num_blocks,
    step_bytes,
    weights_bytes,
)
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.models import Batch, load_model
from edgeinfer.units import human_bytes


class ContextLengthError(EdgeInferError):
    """A sequence would grow past the runner's context length."""


class TokenIdError(EdgeInferError):
    """A token id outside the model's vocabulary (or not an integer)."""


class ModelRunner:
    """forward(seq_id, token_ids) appends tokens to a sequence's KV cache and returns logits.

    ctx: the longest sequence (default: the model's context length, at most DEFAULT_CTX).
    The KV cache holds `kv_budget` bytes' worth of 16-token blocks if given, else `parallel`
    sequences of ctx tokens; either way it must fit the RAM available besides the weights,
    together with the working memory of the largest step: `step_tokens` tokens, of which
    `step_logit_rows` (default: parallel) return logits.
    kv_dtype: "f16" (default) or "f32".
    """

    def __init__(
        self,
        path_or_name: str | Path,
        threads: int | None = None,
        ctx: int | None = None,
        kv_dtype: str = "f16",
        parallel: int = 1,
        kv_budget: int | None = None,
        prefix_caching: bool = True,
        step_tokens: int = PREFILL_CHUNK,
        step_logit_rows: int | None = None,
    ):
        from edgeinfer.gguf.hub import resolve_model

        if kv_dtype not in KV_DTYPES:
            raise EdgeInferError(
                f"kv dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}"
            )
        if ctx is not None and ctx < 1:
            raise EdgeInferError(f"context length must be at least 1, got {ctx}")
        if parallel < 1:
            raise EdgeInferError(f"parallel must be at least 1, got {parallel}")
        self.path = resolve_model(str(path_or_name))
        self.threads = kernels.set_threads(threads)
        self.gguf = read_gguf(self.path)
        self.config = ModelConfig.from_gguf(self.gguf)
        self.model = load_model(self.gguf, self.config)
        self._max_context = ctx if ctx is not None else min(self.config.ctx_len, DEFAULT_CTX)
        num_blocks = kv_num_blocks(self.config, self._max_context, parallel, kv_dtype, kv_budget)
        if not 1 <= step_tokens <= PREFILL_CHUNK:
            raise EdgeInferError(f"tokens per step must be 1 to {PREFILL_CHUNK}, got {step_tokens}")
        self.step_tokens = step_tokens
        self.step_logit_rows = min(step_tokens, step_logit_rows or parallel)
        self.step_bytes = step_bytes(self.config, step_tokens, self.step_logit_rows)
        self._step_source = f"{step_tokens} tokens, logits of {self.step_logit_rows}"
        self._check_kv_budget(num_blocks, kv_dtype, kv_budget)
        self.kv = KVCache.for_model(self.config, num_blocks, kv_dtype, prefix_caching)
        self.kv_source = (
            f"--kv-budget {human_bytes(kv_budget)}"
            if kv_budget is not None
            else f"ctx {self._max_context} x parallel {parallel}"
        )

    def _check_kv_budget(self, num_blocks: int, kv_dtype: str, kv_budget: int | None) -> None:
        """Refuse a KV cache that does not fit the RAM available now besides the weights, before
        allocating it (np.zeros would succeed lazily and the process would be killed later,
        mid-reply), or one too small for a single block."""
        if num_blocks < 1:
            raise EdgeInferError(
                f"a KV budget of {human_bytes(kv_budget)} is less than one "
                f"{BLOCK_SIZE}-token block ({human_bytes(kv_block_bytes(self.config, kv_dtype))})"
            )
        kv = num_blocks * kv_block_bytes(self.config, kv_dtype)
        # mapped weights are not resident yet; they will be once the first pass reads them
        available = psutil.virtual_memory().available - weights_bytes(self.gguf)
        if kv + self.step_bytes > available:
            raise EdgeInferError(
                f"a {kv_dtype} KV cache of {num_blocks * BLOCK_SIZE} tokens needs "
                f"{human_bytes(kv)}, and a step's buffers ({self._step_source}) "
                f"{human_bytes(self.step_bytes)}, but {human_bytes(max(0, available))} of RAM "
                "is available besides the weights; use a smaller --ctx, --parallel or "
                "--kv-budget (`edgeinfer info MODEL` shows the largest context that fits)"
            )

    def kv_report(self) -> str:
        """One line for the start of a run: the cache's size and where it came from."""
        kv = self.kv
        return (
            f"KV cache: {kv.num_blocks} blocks x {kv.block_size} tokens = "
            f"{kv.num_blocks * kv.block_size} tokens, {human_bytes(kv.nbytes)} {kv.dtype} "
            f"({self.kv_source}); step buffers {human_bytes(self.step_bytes)} "
            f"({self._step_source})"
        )

    @cached_property
    def tokenizer(self):
        from edgeinfer.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.gguf)

    @cached_property
    def chat_template(self):
        from edgeinfer.tokenizer.chat_template import ChatTemplate

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
        return self._run(self._check_batch(requests), all_logits)

    def execute(
        self, work: Sequence[tuple[int, Sequence[int], bool]], by_size: bool = False
    ) -> list[np.ndarray | None]:
        """One engine step, one forward pass: [(seq_id, token_ids, wants_logits), ...] (each
        seq_id once; every row takes the row-wise kernels, so a sequence gets the same bits
        whatever it is batched with) -> per entry float32[vocab], the logits after its last
        token, or None (a prompt chunk that does not end the prompt needs no logits and gets no
        head pass). by_size: instead take the fastest kernels for the batch size (at one row,
        the int8 fused kernel)."""
        checked = self._check_batch([(s, ids) for s, ids, _ in work])
        wanted = [w for _, _, w in work]
        rows = iter(self._run(checked, all_logits=False, wanted=wanted, row_wise=not by_size))
        return [next(rows)[0] if w else None for w in wanted]

    def _check_batch(self, requests) -> list[tuple[int, np.ndarray]]:
        seen = set()
        checked = []
        for seq_id, token_ids in requests:
            if seq_id in seen:
                raise EdgeInferError(f"sequence {seq_id} appears twice in one batch")
            seen.add(seq_id)
            checked.append((seq_id, self._check(seq_id, token_ids)))
        return checked

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

    def _run(
        self,
        requests: list[tuple[int, np.ndarray]],
        all_logits: bool,
        wanted: list[bool] | None = None,
        row_wise: bool = False,
    ) -> list[np.ndarray]:
        """-> logits per request: all positions, or the last position of every (wanted)
        request."""
        blocks = self.kv.blocks
        need = sum(blocks.blocks_needed(s, ids.size) for s, ids in requests)
        if need > blocks.num_free_blocks:
            raise KVCacheFullError(
                f"KV cache full: {need} blocks needed, {blocks.num_free_blocks} free "
                f"({blocks.num_blocks} blocks of {blocks.block_size} tokens)"
            )
        # Built from Python lists, one array each: a decode step has a few tokens, and each
        # numpy call on a tiny array costs more than the list it replaces.
        positions, seq_rows, slots, last_rows = [], [], [], []
        for row, (s, ids) in enumerate(requests):
            start = blocks.seq_len(s)
            positions += range(start, start + ids.size)
            seq_rows += [row] * ids.size
            slots += blocks.append(s, ids.size)
            if wanted is None or wanted[row]:
                last_rows.append(len(positions) - 1)
        batch = Batch(
            token_ids=np.concatenate([ids for _, ids in requests]),
            positions=np.array(positions, np.int32),
            seq_rows=np.array(seq_rows, np.int32),
            slots=np.array(slots, np.int64),
            block_tables=self.kv.block_tables([s for s, _ in requests]),
            logit_rows=None if all_logits else np.array(last_rows, np.int64),
            row_wise=row_wise,
        )
        logits = self.model.forward(batch, self.kv.k, self.kv.v)
        if all_logits:
            return np.split(
                logits, np.cumsum([ids.size for _, ids in requests[:-1]], dtype=np.int64)
            )
        return [logits[i : i + 1] for i in range(logits.shape[0])]
