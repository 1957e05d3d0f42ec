"""The engine: continuous batching over one ModelRunner. A step is schedule -> run -> postprocess.

Every request is a `Sequence`. `add` queues it, `step` runs one batched forward pass over the
scheduler's choice (decode tokens of running sequences and prompt chunks of new ones) and
samples a token for every sequence whose tokens are all computed. The engine is driven by one
thread (the caller's for `LLM`, a dedicated one for `AsyncEngine`): Numba's thread pool must
always be entered from the same thread. Other threads may set `seq.aborted` and read `stats()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from time import perf_counter

from edgeinfer.errors import EdgeInferError
from edgeinfer.engine.memory_plan import PREFILL_CHUNK
from edgeinfer.engine.scheduler import Scheduler
from edgeinfer.engine.sequence import Sequence

# Every token of a step takes the row-wise kernels (kernels.matmul), which keeps each sequence's
# arithmetic the same whoever it shares a step with; for prompts they are also faster than BLAS
# on 2-core AVX2 machines (a 512-token step of four prompts: 1.0 s, against 1.4 s with one BLAS
# call per weight; ad-hoc). Steps of decode tokens only may instead take the fastest kernel for
# their size unless `batch_invariant` is set: at a few sequences a 4- or 5-bit unit's int8
# kernel is faster than its row-tile kernel (about 2x at one), but rounds differently, so a
# batch then decodes slightly differently from a request alone.
# Output tokens per second are averaged over this many seconds.
RATE_WINDOW_S = 3.0


class RequestTooLargeError(EdgeInferError):
    """A request that could not fit in the KV cache even running alone."""


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}


class Engine:
    def __init__(
        self,
        runner,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = PREFILL_CHUNK,
        max_wait_ms: float = 0.0,
        batch_invariant: bool = False,
    ):
        # a step must fit the working memory the runner planned (and checked against RAM)
        if max_num_batched_tokens > runner.step_tokens:
            raise EdgeInferError(
                f"max_num_batched_tokens must be at most {runner.step_tokens} (the runner's "
                f"planned step), got {max_num_batched_tokens}"
            )
        if min(max_num_seqs, max_num_batched_tokens) > runner.step_logit_rows:
            raise EdgeInferError(
                f"max_num_seqs must be at most {runner.step_logit_rows} (the logits the "
                f"runner's planned step holds), got {max_num_seqs}"
            )
        self.runner = runner
        self.batch_invariant = batch_invariant
        self.blocks = runner.kv.blocks
        self.scheduler = Scheduler(
            self.blocks, max_num_seqs, max_num_batched_tokens, max_wait_ms / 1000
        )
        self.generated_tokens = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self.wait_s = 0.0  # after a step that ran nothing: how long to wait for more requests

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.scheduler.add(seq, perf_counter())

    def abort(self, seq: Sequence) -> None:
        """End a request now and free its blocks (from the driving thread; other threads set
        `seq.aborted` instead)."""
        if not seq.finished:
            seq.finish_reason = "abort"
        self.scheduler.remove(seq)

    def check(self, seq: Sequence) -> None:
        """Refuse a request that the KV cache could not hold even alone (it would be preempted
        forever)."""
        longest = min(
            seq.max_context,
            seq.num_prompt_tokens + (seq.params.max_tokens or seq.max_context),
        )
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if longest > capacity:
            raise RequestTooLargeError(
                f"the request can grow to {longest} tokens (prompt {seq.num_prompt_tokens} + "
                f"max_tokens) but the KV cache holds {capacity} tokens in all; lower max_tokens "
                "or raise --kv-budget / --parallel"
            )

    def step(self) -> list[tuple[Sequence, str]]:
        """Run one step -> (sequence, new text) for every sequence that got a token or ended
        (an aborted one ends with finish_reason 'abort' and empty text)."""
        outputs = self._reap_aborted()
        now = perf_counter()
        batch = self.scheduler.schedule(now)
        self.wait_s = batch.wait_s
        if not batch.chunks:
            return outputs
        work = []
        decode_only = True
        for seq, n in batch.chunks:
            if seq.t_scheduled is None:
                seq.t_scheduled = now
                seq.num_cached_tokens = seq.num_computed
            start = seq.num_computed
            decode_only &= n == 1 and start >= seq.num_prompt_tokens
            ends_prompt = start + n == len(seq.token_ids)
            work.append((seq.seq_id, seq.token_ids[start : start + n], ends_prompt))
        logits = self.runner.execute(work, by_size=decode_only and not self.batch_invariant)
        sampled = 0
        for (seq, n), row in zip(batch.chunks, logits, strict=True):
            seq.num_computed += n
            self.blocks.commit(seq.seq_id, seq.token_ids)
            if row is None:
                continue
            delta = seq.append(seq.sample(row))
            sampled += 1
            if seq.finished:
                self.scheduler.remove(seq)
            outputs.append((seq, delta))
        self.generated_tokens += sampled
        self._recent.append((perf_counter(), sampled))
        return outputs

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
        b = self.blocks
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
        )
