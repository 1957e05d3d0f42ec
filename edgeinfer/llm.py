"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))`, named after vLLM's.

Every request is a `Sequence` run by the continuous-batching `Engine`: `generate` and `chat`
with several prompts run them concurrently, and streams advance the engine from the thread
that iterates them (several streams may be open at once; each step serves all of them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import numpy as np

from edgeinfer.config import EngineConfig
from edgeinfer.engine.engine import Engine, EngineStats
from edgeinfer.engine.outputs import Completion, Metrics
from edgeinfer.engine.requests import Messages, Prompt, PromptError, check_token_ids, is_token
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.engine.sequence import Sequence
from edgeinfer.errors import EdgeInferError
from edgeinfer.gc_pause import start_up

__all__ = ["LLM", "Completion", "Metrics", "PromptError", "Stream"]


class Stream:
    """Iterator over a request's text deltas; `.completion` holds the result once it is done.

    Closing it early (or dropping it) frees the request's KV cache.
    """

    def __init__(self, seq: Sequence, deltas: Iterator[str]):
        self._seq = seq
        self._deltas = deltas

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()

    def cancel(self) -> None:
        """Stop the request before its next forward step; safe to call from any thread.

        Unlike `close`, it works while another thread is blocked in the iteration (even on a
        reply that has produced no text yet): the iteration ends with finish_reason 'abort'
        and frees the request's KV cache.
        """
        self._seq.aborted = True

    @property
    def sequence(self) -> Sequence:
        """The request's live state (token counts, timings), for progress displays."""
        return self._seq

    @property
    def completion(self) -> Completion:
        if not self._seq.finished:
            raise EdgeInferError("the stream has not finished yet")
        if self._seq.t_first_token is None:  # cancelled before its first token: no timings
            raise EdgeInferError("the request was cancelled before it produced a token")
        return Completion.from_sequence(self._seq)


class LLM:
    """A loaded model. `model` is a GGUF path or a short name (`edgeinfer pull` lists them).

    The keyword arguments are `EngineConfig`'s (threads, ctx, parallel, kv_budget, kv_dtype,
    max_num_seqs, max_num_batched_tokens, max_wait_ms, prefix_caching, batch_invariant,
    precision, speculative, spec_k, offload, gpu_layers, rpc), or
    pass a whole `config`. KV cache: `parallel` sequences of `ctx` tokens, or `kv_budget` bytes;
    any mix of requests shares it. `batch_invariant` makes every request's tokens the same as
    running it alone, bit for bit, at the price of a slower single-sequence decode.
    `precision="exact"` keeps activations float everywhere (README: Precision); the default
    "fast" rounds prompt rows to int8 blocks for an integer GEMM.
    `speculative="ngram"` drafts up to `spec_k` tokens per step from the prompt and output so
    far and verifies them in one pass (README: Speculative decoding).
    """

    def __init__(self, model: str, config: EngineConfig | None = None, **knobs):
        from edgeinfer.engine.runner import ModelRunner

        if config is None:
            config = EngineConfig(**knobs)
        elif knobs:
            raise EdgeInferError("pass either an EngineConfig or its keyword arguments")
        with start_up("load a model"):
            self.engine = Engine(ModelRunner(model, config), config)
        self._runner = self.engine.runner
        self.requests = self.engine.requests
        self.config = self._runner.config
        self.tokenizer = self._runner.tokenizer
        self._pending: dict[int, deque[str]] = {}  # text not yet read from each open stream

    @property
    def chat_template(self):
        """The model's ChatTemplate, or None for a base model. Compiled on first use, so a
        template that does not compile only fails the requests that need it."""
        return self._runner.chat_template

    @property
    def gguf(self):
        """The loaded model's GGUFFile (metadata and tensor table), already parsed."""
        return self._runner.gguf

    @property
    def threads(self) -> int:
        """CPU threads the kernels use."""
        return self._runner.threads

    @property
    def max_context(self) -> int:
        return self._runner.max_context

    def kv_usage(self) -> tuple[int, int]:
        """(used, total) blocks of the paged KV cache."""
        blocks = self.engine.blocks
        return blocks.num_used_blocks, blocks.num_blocks

    def kv_report(self) -> str:
        """The KV cache's size and where it came from, in one line (and a draft model's, in a
        second line, with `speculative="draft:MODEL"`)."""
        spec = self.engine.speculator
        draft = spec.proposer.kv_report() if spec else None
        return self._runner.kv_report() + (f"\ndraft model {draft}" if draft else "")

    def placement(self) -> str:
        """Which layers run where (edgeinfer's kernels, a ggml backend) and what a ggml span
        holds on its device, in one line."""
        return self._runner.placement()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Logits after every position: # token_ids: [n] -> [n, vocab] float32 (for evaluation)."""
        ids = check_token_ids(token_ids, self.config.vocab_size, limit=self.max_context)
        seq_id = self.requests.next_id()
        try:
            return self.engine.forward(seq_id, ids)
        finally:
            self.engine.release(seq_id)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete each prompt (text or token ids), all concurrently; one Completion per
        prompt, in order."""
        if isinstance(prompts, str) or (len(prompts) and is_token(prompts[0])):
            prompts = [prompts]
        return self._complete(self._requests(prompts, params))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Stream:
        """Text deltas of one completion as they are produced (stop strings never leak)."""
        (seq,) = self._requests([prompt], params)
        return self._open_stream(seq)

    def chat(
        self, messages: Messages | Seq[Messages], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Reply to one conversation or to each of a list of them (concurrently), using the
        model's template."""
        convs = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        return self._complete(self._requests(convs, params))

    def stream_chat(self, messages: Messages, params: SamplingParams | None = None) -> Stream:
        (seq,) = self._requests([messages], params)
        return self._open_stream(seq)

    def chat_token_ids(self, messages: Messages) -> list[int]:
        """The prompt a conversation becomes (the model's chat template, or for a base model
        the messages' contents one per line)."""
        return self.requests.chat_token_ids(messages)

    def _requests(self, prompts, params) -> list[Sequence]:
        """Check every request before any compute, then make their Sequences."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise EdgeInferError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        return [self.requests.from_prompt(p, sp) for p, sp in zip(prompts, params, strict=True)]

    def _complete(self, seqs: list[Sequence]) -> list[Completion]:
        try:
            for seq in seqs:
                self.engine.add(seq)
            while not all(seq.finished for seq in seqs):
                self._step()
        finally:  # interrupted (KeyboardInterrupt, an error): nothing stays in the engine
            for seq in seqs:
                if not seq.finished:
                    self.engine.abort(seq)
        return [Completion.from_sequence(seq) for seq in seqs]

    def _open_stream(self, seq: Sequence) -> Stream:
        self.engine.add(seq)
        self._pending[seq.seq_id] = deque()
        return Stream(seq, self._deltas(seq))

    def _deltas(self, seq: Sequence) -> Iterator[str]:
        pending = self._pending[seq.seq_id]
        try:
            while True:
                if pending:
                    yield pending.popleft()
                elif seq.finished:
                    return
                else:
                    self._step()
        finally:  # closed early (or dropped): free the request now
            del self._pending[seq.seq_id]
            if not seq.finished:
                self.engine.abort(seq)

    def _step(self) -> None:
        for seq, delta in self.engine.step():
            if delta and seq.seq_id in self._pending:
                self._pending[seq.seq_id].append(delta)
        if self.engine.wait_s:
            time.sleep(self.engine.wait_s)
