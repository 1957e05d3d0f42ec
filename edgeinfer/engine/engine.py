"""The engine: continuous batching over one ModelRunner. A step is schedule -> run -> postprocess.

Every request is a `Sequence`. `add` queues it, `step` runs one batched forward pass over the
scheduler's choice (decode tokens of running sequences and prompt chunks of new ones) and
samples a token for every sequence whose tokens are all computed. With speculative decoding
(`config.speculative`) a decoding sequence may carry draft tokens; the step verifies them and
keeps the accepted ones plus one token more (see edgeinfer.speculative). The engine is driven by one
thread (the caller's for `LLM`, a dedicated one for `AsyncEngine`): Numba's thread pool must
always be entered from the same thread. Other threads may set `seq.aborted` and read `stats()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from time import perf_counter

import numpy as np

from edgeinfer.config import EngineConfig
from edgeinfer.engine.block_manager import BlockManager
from edgeinfer.engine.kv_cache import BLOCK_SIZE
from edgeinfer.engine.requests import PromptError, Requests, check_token_ids
from edgeinfer.engine.scheduler import ScheduledBatch, Scheduler
from edgeinfer.engine.sequence import Sequence
from edgeinfer.errors import DeviceLostError
from edgeinfer.models.base import ROW_WISE_EXACT, ROW_WISE_INT8
from edgeinfer.speculative import make_speculator

# Output tokens per second are averaged over this many seconds.
RATE_WINDOW_S = 3.0


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int  # free, but holding reusable prefixes
    prefix_cache_queried_tokens: int  # prompt tokens looked up at admission
    prefix_cache_hit_tokens: int  # of those, reused from the cache
    preemptions: int
    generated_tokens: int  # since the engine started
    tokens_per_s: float  # output tokens per second over the last RATE_WINDOW_S seconds
    # a model with sliding-window layers (gemma3): their own pool's blocks (0 without one)
    kv_window_blocks_used: int = 0
    kv_window_blocks_total: int = 0
    kv_window_blocks_cached: int = 0
    spec_drafts: int = 0  # speculative decoding: steps of a sequence that verified a draft
    spec_proposed_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        p = self.spec_proposed_tokens
        return self.spec_accepted_tokens / p if p else 0.0

    @property
    def spec_mean_accepted(self) -> float:
        """Draft tokens accepted per verified draft (each verify step also adds one token)."""
        return self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "spec_acceptance_rate": self.spec_acceptance_rate,
            "spec_mean_accepted": self.spec_mean_accepted,
        }


class Engine:
    """Continuous batching over `runner` (a ModelRunner), with the knobs of `config`."""

    def __init__(self, runner, config: EngineConfig):
        self.runner = runner
        self.config = config
        window = runner.config.sliding_window
        self.scheduler = Scheduler(
            BlockManager(runner.num_blocks, BLOCK_SIZE, config.prefix_caching),
            config,
            BlockManager(runner.num_window_blocks, BLOCK_SIZE, config.prefix_caching, window)
            if runner.num_window_blocks
            else None,
        )
        self.blocks = self.scheduler.blocks  # read-only here: the scheduler owns it
        self.window_blocks = self.scheduler.window_blocks  # read-only too; None: no window pool
        self.requests = Requests(runner, runner.num_blocks * BLOCK_SIZE)
        self.generated_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self.wait_s = 0.0  # after a step that ran nothing: how long to wait for more requests
        self.speculator = make_speculator(config, runner) if config.speculative else None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add(self, seq: Sequence) -> None:
        """Queue a request made by `self.requests` (checked there, so trusted here)."""
        self.scheduler.add(seq, perf_counter())

    def abort(self, seq: Sequence) -> None:
        """End a request now and free its blocks (from the driving thread; other threads set
        `seq.aborted` instead)."""
        if not seq.finished:
            seq.finish_reason = "abort"
        self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if self.speculator:
            self.speculator.forget(seq.seq_id)

    def step(self) -> list[tuple[Sequence, str]]:
        """Run one step -> (sequence, new text) for every sequence that got a token or ended
        (an aborted one ends with finish_reason 'abort' and empty text)."""
        outputs = self._reap_aborted()
        now = perf_counter()
        drafts = None
        if self.speculator:
            drafts = self.speculator.drafts(self.scheduler.running, self.scheduler.draft_room())
        batch = self.scheduler.schedule(now, drafts)
        self.wait_s = batch.wait_s
        if not batch.chunks:
            return outputs
        logits = self._execute(batch.chunks, self._row_wise(batch))
        return outputs + self._postprocess(batch, logits, now)

    def _execute(self, chunks, row_wise, all_logits: bool = False):
        try:
            return self.runner.execute(chunks, row_wise, all_logits)
        except DeviceLostError:
            # a device holding part of every sequence's K/V is gone (a ggml RPC server): the
            # sequences fail, and no prefix cached before may be reused
            for seq in list(self.scheduler.running):
                self.abort(seq)
            self.scheduler.reset_prefix_cache()
            raise

    def _row_wise(self, batch: ScheduledBatch) -> bool | str:
        return self._kernels(
            all(
                len(c.token_ids) == 1 + c.num_draft and c.start >= c.seq.num_prompt_tokens
                for c in batch.chunks
            )
        )

    def _kernels(self, decode: bool) -> bool | str:
        """-> Batch.row_wise: precision "exact" takes float activations everywhere; otherwise
        prompt rows take the row-wise kernels with int8 activations where the type gains by it,
        and a step of decode tokens the fastest kernels for its size unless the config asks for
        batch invariance."""
        if self.config.precision == "exact":
            return ROW_WISE_EXACT
        if self.config.batch_invariant:
            return True
        return False if decode else ROW_WISE_INT8

    def _postprocess(self, batch: ScheduledBatch, logits, now: float) -> list:
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.t_scheduled is None:
                seq.t_scheduled = now
                seq.num_cached_tokens = chunk.start
        sampled, rejected = [], {}
        for chunk, rows in zip(batch.chunks, logits, strict=True):
            if rows is None:
                continue
            seq = chunk.seq
            if chunk.num_draft:
                tokens = seq.verify(rows, chunk.token_ids[-chunk.num_draft :])
                accepted = len(tokens) - 1
                rejected[seq.seq_id] = chunk.num_draft - accepted
                self.speculator.record(seq.seq_id, chunk.num_draft, accepted)
            else:
                tokens = [seq.sample(rows)]
            sampled.append((seq, tokens))
        self.scheduler.commit(batch, rejected)
        outputs, made = [], 0
        for seq, tokens in sampled:
            before = seq.num_output_tokens
            outputs.append((seq, seq.extend(tokens)))
            made += seq.num_output_tokens - before
            if seq.finished:
                self._remove(seq)
        self.generated_tokens += made
        self._recent.append((perf_counter(), made))
        return outputs

    def forward(self, seq_id: int, token_ids) -> np.ndarray:
        """Evaluation outside the queue: append token_ids to sequence seq_id's cache ->
        float32[n, vocab], the logits after each of them (chunks of max_num_batched_tokens, the
        kernels a step would take for them). `release(seq_id)` frees its blocks. Bad ids or a
        sequence past the context raise PromptError and change nothing."""
        have = self.scheduler.seq_len(seq_id)
        ids = check_token_ids(token_ids, self.runner.config.vocab_size)
        ctx = self.runner.max_context
        if have + len(ids) > ctx:
            raise PromptError(
                f"sequence {seq_id}: {have} + {len(ids)} tokens exceed the context length {ctx}"
            )
        step = self.config.max_num_batched_tokens
        rows = []
        for i in range(0, len(ids), step):
            chunk = self.scheduler.extend(seq_id, ids[i : i + step], have + i)
            decode = len(chunk.token_ids) == 1  # as a step would run it
            rows += self._execute([chunk], self._kernels(decode), all_logits=True)
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def release(self, seq_id: int) -> None:
        self.scheduler.release(seq_id)

    def _reap_aborted(self) -> list[tuple[Sequence, str]]:
        s = self.scheduler
        gone = [q for q in s.running + s.waiting if q.aborted]
        for seq in gone:
            self.abort(seq)
        return [(seq, "") for seq in gone]

    def stats(self) -> EngineStats:
        """A snapshot; call it from the thread that drives the engine."""
        now = perf_counter()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        # the oldest step's tokens were made before the span being measured began
        span = now - self._recent[0][0] if self._recent else 0.0
        recent = sum(n for _, n in self._recent) - (self._recent[0][1] if self._recent else 0)
        b, w = self.blocks, self.window_blocks
        window = (
            dict(
                kv_window_blocks_used=w.num_used_blocks,
                kv_window_blocks_total=w.num_blocks,
                kv_window_blocks_cached=w.num_cached_blocks,
            )
            if w
            else {}
        )
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=b.num_used_blocks,
            kv_blocks_total=b.num_blocks,
            kv_blocks_cached=b.num_cached_blocks,
            prefix_cache_queried_tokens=b.num_queried_tokens,
            prefix_cache_hit_tokens=b.num_hit_tokens,
            preemptions=self.scheduler.num_preemptions,
            generated_tokens=self.generated_tokens,
            tokens_per_s=recent / span if span > 0 else 0.0,
            **window,
            **(self.speculator.counts() if self.speculator else {}),
        )
