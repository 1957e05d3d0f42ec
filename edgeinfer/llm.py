"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))`, named after vLLM's.

Every request is a `Sequence` run by the continuous-batching `Engine`: `generate` and `chat`
with several prompts run them concurrently, and streams advance the engine from the thread
that iterates them (several streams may be open at once; each step serves all of them).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import numpy as np

from edgeinfer.engine.outputs import Completion, Metrics
from edgeinfer.engine.engine import Engine, EngineStats
from edgeinfer.errors import EdgeInferError
from edgeinfer.engine.memory_plan import PREFILL_CHUNK
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.engine.sequence import Sequence

__all__ = ["LLM", "Completion", "Metrics", "PromptError", "Stream"]

Prompt = str | Seq[int]  # text, or token ids used as they are
Messages = Seq[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]


class PromptError(EdgeInferError, ValueError):
    """A prompt that cannot run: empty, longer than the context, or with out-of-vocab ids."""


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

    KV cache: `parallel` sequences of `ctx` tokens, or `kv_budget` bytes of 16-token blocks;
    any mix of requests shares it. Up to `max_num_seqs` requests run per step, with at most
    `max_num_batched_tokens` tokens in one forward pass; with nothing running, a partial batch
    waits up to `max_wait_ms` for more requests; `prefix_caching` reuses the K/V of a prompt's
    leading blocks when an earlier request had the same tokens. `batch_invariant` makes every
    request's tokens the same as running it alone, bit for bit (vLLM's batch-invariant mode),
    at the price of a slower single-sequence decode.
    """

    def __init__(
        self,
        model: str,
        threads: int | None = None,
        ctx: int | None = None,
        kv_dtype: str = "f16",
        parallel: int = 4,
        kv_budget: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = PREFILL_CHUNK,
        prefix_caching: bool = True,
        max_wait_ms: float = 0.0,
        batch_invariant: bool = False,
    ):
        from edgeinfer.engine.runner import ModelRunner

        self._runner = ModelRunner(
            model,
            threads=threads,
            ctx=ctx,
            kv_dtype=kv_dtype,
            parallel=parallel,
            kv_budget=kv_budget,
            prefix_caching=prefix_caching,
            step_tokens=max_num_batched_tokens,
            step_logit_rows=max_num_seqs,
        )
        self.engine = Engine(
            self._runner, max_num_seqs, max_num_batched_tokens, max_wait_ms, batch_invariant
        )
        self.config = self._runner.config
        self.tokenizer = self._runner.tokenizer
        self._seq_ids = itertools.count()
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
        blocks = self._runner.kv.blocks
        return blocks.num_used_blocks, blocks.num_blocks

    def kv_report(self) -> str:
        """The KV cache's size and where it came from, in one line."""
        return self._runner.kv_report()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def logits(self, token_ids: Seq[int]) -> np.ndarray:
        """Logits after every position: # token_ids: [n] -> [n, vocab] float32 (for evaluation)."""
        ids = self._check_ids(token_ids, limit=self.max_context)
        seq_id = next(self._seq_ids)
        try:
            return self._runner.forward(seq_id, ids)
        finally:
            self._runner.free(seq_id)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete each prompt (text or token ids), all concurrently; one Completion per
        prompt, in order."""
        if isinstance(prompts, str) or (len(prompts) and _is_token(prompts[0])):
            prompts = [prompts]
        return self._complete(self._sequences([self._encode(p) for p in prompts], params, prompts))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Stream:
        """Text deltas of one completion as they are produced (stop strings never leak)."""
        (seq,) = self._sequences([self._encode(prompt)], params, [prompt])
        return self._open_stream(seq)

    def chat(
        self, messages: Messages | Seq[Messages], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Reply to one conversation or to each of a list of them (concurrently), using the
        model's template."""
        convs = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        return self._complete(
            self._sequences([self.chat_token_ids(c) for c in convs], params, None)
        )

    def stream_chat(self, messages: Messages, params: SamplingParams | None = None) -> Stream:
        (seq,) = self._sequences([self.chat_token_ids(messages)], params, None)
        return self._open_stream(seq)

    def chat_token_ids(self, messages: Messages) -> list[int]:
        """The prompt a conversation becomes.

        With a chat template: the rendered template, tokenized with special tokens parsed. A
        base model has none; like Ollama (whose default template is the bare prompt) and
        design.md, it then runs as a plain completion of the messages' contents, one per line.
        """
        if not messages or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise PromptError("messages must be a non-empty list of {'role': str, 'content': str}")
        if self.chat_template is None:
            return self._encode("\n".join(m["content"] for m in messages))
        ids = self.tokenizer.encode(self.chat_template.render(list(messages)), special=True)
        # templates that write the BOS token themselves would otherwise get a second one
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and bos is not None and ids[0] == ids[1] == bos:
            ids = ids[1:]
        return ids

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            # special=True: control tokens written in the prompt mean themselves, as in
            # llama.cpp's completion tools and llama-cpp-python's create_completion
            return self.tokenizer.encode(prompt, special=True)
        return self._check_ids(prompt, limit=None)

    def _check_ids(self, ids: Seq[int], limit: int | None) -> list[int]:
        vocab = self.config.vocab_size
        ids = [int(t) for t in ids]
        if not ids:
            raise PromptError("the prompt is empty (no tokens to run)")
        if not all(0 <= t < vocab for t in ids):
            raise PromptError(f"token ids must be in [0, {vocab}) for this model")
        if limit is not None and len(ids) > limit:
            raise PromptError(f"{len(ids)} tokens do not fit the context of {limit} tokens")
        return ids

    def _sequences(self, prompt_ids: list[list[int]], params, prompts) -> list[Sequence]:
        """Validate every request before any compute, then make their Sequences."""
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompt_ids)
        if len(params) != len(prompt_ids):
            raise EdgeInferError(f"{len(params)} SamplingParams for {len(prompt_ids)} prompts")
        ctx = self.max_context
        for ids in prompt_ids:
            if not ids:
                raise PromptError("the prompt is empty (no tokens to run)")
            if len(ids) >= ctx:
                raise PromptError(
                    f"the prompt is {len(ids)} tokens but the context holds {ctx} (including at"
                    " least one generated token): shorten the prompt or raise the context (--ctx)"
                )
        texts = [p if isinstance(p, str) else None for p in prompts or [None] * len(prompt_ids)]
        seqs = [
            Sequence(next(self._seq_ids), ids, p, self.tokenizer, ctx, prompt=text)
            for ids, p, text in zip(prompt_ids, params, texts, strict=True)
        ]
        for seq in seqs:
            self.engine.check(seq)
        return seqs

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


def _is_token(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
