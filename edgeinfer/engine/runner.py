"""ModelRunner: a loaded model plus the arrays of its paged KV cache; turns a scheduled step into
arrays (token ids, positions, slot mapping, block tables) and those into logits.

It trusts what it is given: requests are validated once when they are made
(`engine.requests`), and the scheduler hands out the cache slots, so models never compute block
ids and the runner never changes which sequence owns which block.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np
import psutil

from edgeinfer import kernels
from edgeinfer.config import DEFAULT_CTX, EngineConfig
from edgeinfer.engine.kv_cache import BLOCK_SIZE, KVCache
from edgeinfer.engine.memory_plan import (
    kv_block_bytes,
    kv_pools,
    kv_pools_bytes,
    step_bytes,
    weights_bytes,
    window_layers,
)
from edgeinfer.engine.scheduler import Chunk
from edgeinfer.errors import EdgeInferError
from edgeinfer.ggml.placement import resolve, rpc_endpoints
from edgeinfer.ggml.rpc import free_memory
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.models import load_model
from edgeinfer.models.base import Batch
from edgeinfer.units import human_bytes


class ModelRunner:
    """The model at `path_or_name` with a KV cache sized by `config` (see EngineConfig).

    The cache must fit the RAM available besides the weights, together with the working memory
    of the largest step: max_num_batched_tokens tokens, of which step_logit_rows return logits.
    Its sliding-window layers keep a window per sequence in a pool of their own (see
    engine.block_manager) unless window_capped is False (a draft model's runner, whose blocks
    are handed out outside the scheduler).
    """

    def __init__(self, path_or_name: str, config: EngineConfig, window_capped: bool = True):
        from edgeinfer.gguf.hub import resolve_model

        self.path = resolve_model(str(path_or_name))
        self.threads = kernels.set_threads(config.threads)
        self.gguf = read_gguf(self.path)
        self.config = ModelConfig.from_gguf(self.gguf)
        servers = rpc_endpoints(config.offload, config.rpc)
        free = free_memory(servers) if servers else {}  # (probing them: one clear error)
        self.span = resolve(config.offload, config.gpu_layers, self.config.n_layers, config.rpc,
                            free)  # fmt: skip
        self.model = load_model(self.gguf, self.config, self.span)
        self.host_layers = (
            self.model.host_layers(self.span) if self.span else list(range(self.config.n_layers))
        )
        self.max_context = (
            config.ctx if config.ctx is not None else min(self.config.ctx_len, DEFAULT_CTX)
        )
        self.window_layers = window_layers(self.config, self.host_layers) if window_capped else []
        self.num_blocks, self.num_window_blocks = kv_pools(
            self.config, self.max_context, config.parallel, config.kv_dtype, config.kv_budget,
            self.host_layers, self.window_layers, config.max_num_batched_tokens,
        )  # fmt: skip
        self.step_bytes = step_bytes(
            self.config, config.max_num_batched_tokens, config.step_logit_rows
        )
        self._step_source = (
            f"{config.max_num_batched_tokens} tokens, logits of {config.step_logit_rows}"
        )
        self._check_kv_budget(config.kv_dtype, config.kv_budget)
        self.kv = KVCache.for_model(
            self.config, self.num_blocks, config.kv_dtype, self.host_layers, self.window_layers,
            self.num_window_blocks,
        )  # fmt: skip
        self.executor = None
        if self.span is not None:
            self.executor = self._span_executor(config)
        self.kv_source = (
            f"--kv-budget {human_bytes(config.kv_budget)}"
            if config.kv_budget is not None
            else f"ctx {self.max_context} x parallel {config.parallel}"
        )

    def _span_executor(self, config: EngineConfig):
        """The ggml executor of the offloaded span (its parts on each backend), handed to the
        model."""
        from edgeinfer.ggml.executor import open_executor

        plan = (self.num_blocks, BLOCK_SIZE, config.kv_dtype, config.max_num_batched_tokens,
                config.step_logit_rows)  # fmt: skip
        # ggml's OpenMP team and Numba's run in turn, never at once: the same thread count
        ex = open_executor(self.model, self.gguf, self.path, self.span, plan, self.threads)
        if config.batch_invariant:
            ex.make_batch_invariant()
        self.model.attach(ex)
        return ex

    def _check_kv_budget(self, kv_dtype: str, kv_budget: int | None) -> None:
        """Refuse a KV cache that does not fit the RAM available now besides the weights, before
        allocating it (np.zeros would succeed lazily and the process would be killed later,
        mid-reply), or one too small for a single block."""
        num_blocks = self.num_blocks
        if num_blocks < 1:
            raise EdgeInferError(
                f"a KV budget of {human_bytes(kv_budget)} is less than one "
                f"{BLOCK_SIZE}-token block ({human_bytes(kv_block_bytes(self.config, kv_dtype))})"
            )
        kv = kv_pools_bytes(
            self.config, kv_dtype, len(self.host_layers), len(self.window_layers), num_blocks,
            self.num_window_blocks,
        )  # fmt: skip
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
        window = (
            f" (its {len(kv.window_layers)} sliding-window layers: {kv.num_window_blocks} blocks)"
            if kv.window_layers
            else ""
        )
        return (
            f"KV cache: {kv.num_blocks} blocks x {kv.block_size} tokens = "
            f"{kv.num_blocks * kv.block_size} tokens{window}, {human_bytes(kv.nbytes)} "
            f"{kv.dtype} ({self.kv_source}); step buffers {human_bytes(self.step_bytes)} "
            f"({self._step_source})"
        ) + (f"\n{self.placement()}" if self.executor else "")

    def placement(self) -> str:
        """Which layers run where, and what a ggml span holds on its device, in one line."""
        n = self.config.n_layers
        if self.executor is None:
            return f"all {n} layers on edgeinfer's kernels"
        host = self.host_layers
        runs = [f"{a}-{b}" if a != b else f"{a}" for a, b in _runs(host)]
        noun = "layer" if len(host) == 1 else "layers"
        on_host = f"; {noun} {', '.join(runs)} on edgeinfer's kernels" if host else ""
        return self.executor.report() + on_host

    @cached_property
    def tokenizer(self):
        from edgeinfer.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.gguf)

    @cached_property
    def chat_template(self):
        from edgeinfer.tokenizer.chat_template import ChatTemplate

        return ChatTemplate.from_gguf(self.gguf)

    def execute(
        self, chunks: Sequence[Chunk], row_wise: bool, all_logits: bool = False
    ) -> list[np.ndarray | None]:
        """One forward pass over the chunks -> per chunk the float32[vocab] logits after its last
        token if it wants them, else None (its K/V are written and no head pass is made); a
        chunk with draft tokens gets float32[1 + num_draft, vocab], the logits after its last
        known token and after each draft token.
        all_logits: every chunk gets float32[n, vocab], the logits after each of its tokens.
        row_wise: every matmul takes the row-wise kernels, so a sequence gets the same bits
        whatever it is batched with (False: the fastest kernels for the batch size)."""
        # Built from Python lists, one array each: a decode step has a few tokens, and each
        # numpy call on a tiny array costs more than the list it replaces.
        positions, seq_rows, slots, last_rows = [], [], [], []
        for row, c in enumerate(chunks):
            positions += range(c.start, c.start + len(c.token_ids))
            seq_rows += [row] * len(c.token_ids)
            slots += c.slots
            if c.wants_logits:
                last_rows += range(len(positions) - 1 - c.num_draft, len(positions))
        tables = _tables([c.block_table for c in chunks])
        window = self.kv.window_layers
        batch = Batch(
            token_ids=np.fromiter(
                (t for c in chunks for t in c.token_ids), np.int32, len(positions)
            ),
            positions=np.array(positions, np.int32),
            seq_rows=np.array(seq_rows, np.int32),
            slots=np.array(slots, np.int64),
            block_tables=tables,
            logit_rows=None if all_logits else np.array(last_rows, np.int64),
            row_wise=row_wise,
            window_slots=np.array([s for c in chunks for s in c.window_slots], np.int64)
            if window
            else None,
            window_block_tables=_tables([c.window_block_table for c in chunks]) if window else None,
        )
        logits = self.model.forward(batch, self.kv.k, self.kv.v)
        if all_logits:
            sizes = [len(c.token_ids) for c in chunks[:-1]]
            return np.split(logits, np.cumsum(sizes, dtype=np.int64))
        out, row = [], 0
        for c in chunks:
            n = 1 + c.num_draft if c.wants_logits else 0
            out.append(None if not n else logits[row] if n == 1 else logits[row : row + n])
            row += n
        return out


def _tables(rows: list[list[int]]) -> np.ndarray:
    """Block tables as int32[n_rows, longest]; padding (and a window table's RELEASED
    entries) is never read."""
    tables = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
    for table, row in zip(tables, rows, strict=True):
        table[: len(row)] = row
    return tables


def _runs(layers: list[int]) -> list[tuple[int, int]]:
    """Consecutive layer numbers as (first, last) runs: [0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    runs: list[tuple[int, int]] = []
    for i in layers:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs
