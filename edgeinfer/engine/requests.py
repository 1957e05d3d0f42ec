"""From what a caller sends (text, token ids, or chat messages) to a checked request: a
`Sequence` the engine can run without checking it again. `LLM` and `AsyncEngine` both go
through here, so a request is validated once, before any state changes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import numpy as np

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.engine.sequence import Sequence
from edgeinfer.errors import EdgeInferError

Prompt = str | Seq[int]  # text, or token ids used as they are
Messages = Seq[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]


class PromptError(EdgeInferError, ValueError):
    """A prompt that cannot run: empty, longer than the context, or with out-of-vocab ids."""


class RequestTooLargeError(EdgeInferError):
    """A request that could not fit in the KV cache even running alone."""


def is_token(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_token_ids(ids: Seq[int], vocab_size: int, limit: int | None = None) -> list[int]:
    """-> the ids as ints; PromptError if empty, not integers, out of [0, vocab_size), or
    more than `limit`."""
    if not all(is_token(t) for t in ids):
        raise PromptError("token ids must be integers")
    ids = [int(t) for t in ids]
    if not ids:
        raise PromptError("the prompt is empty (no tokens to run)")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"token id {bad} is out of range [0, {vocab_size}) for this model")
    if limit is not None and len(ids) > limit:
        raise PromptError(f"{len(ids)} tokens do not fit the context of {limit} tokens")
    return ids


class Requests:
    """Makes the requests of one loaded model (`runner`: a ModelRunner) whose KV cache holds
    `kv_tokens` tokens in all. Thread-safe: `AsyncEngine` makes requests on the caller's thread
    while the engine thread runs."""

    def __init__(self, runner, kv_tokens: int):
        self._runner = runner
        self.tokenizer = runner.tokenizer
        self.vocab_size = runner.config.vocab_size
        self.max_context = runner.max_context
        self.kv_tokens = kv_tokens
        self._seq_ids = itertools.count()

    @property
    def chat_template(self):
        """The model's ChatTemplate, or None for a base model. Compiled on first use, so a
        template that does not compile only fails the requests that need it."""
        return self._runner.chat_template

    def next_id(self) -> int:
        return next(self._seq_ids)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            # special=True: control tokens written in the prompt mean themselves, as in
            # llama.cpp's completion tools and llama-cpp-python's create_completion
            return self.tokenizer.encode(prompt, special=True)
        return check_token_ids(prompt, self.vocab_size)

    def chat_token_ids(self, messages: Messages, template=None, **variables) -> list[int]:
        """The prompt a conversation becomes.

        With a chat template (`template`, a ChatTemplate, else the model's): the rendered
        template, tokenized with special tokens parsed; `variables` (tools, ...) go to the
        template. A base model has none; like Ollama (whose default template is the bare
        prompt) and design.md, it then runs as a plain completion of the messages' contents,
        one per line.
        """
        if not messages or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise PromptError("messages must be a non-empty list of {'role': str, 'content': str}")
        template = template or self.chat_template
        if template is None:
            return self.encode("\n".join(m["content"] for m in messages))
        ids = self.tokenizer.encode(template.render(list(messages), **variables), special=True)
        # templates that write the BOS token themselves would otherwise get a second one
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and bos is not None and ids[0] == ids[1] == bos:
            ids = ids[1:]
        return ids

    def make(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        priority: int = 0,
        request_id: str | None = None,
    ) -> Sequence:
        """A Sequence for checked token ids: refused if it leaves no room for a generated token
        in the context, or could outgrow the whole KV cache (it would be preempted forever)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise EdgeInferError(f"expected SamplingParams, got {type(params).__name__}")
        ctx, n = self.max_context, len(prompt_ids)
        if not n:
            raise PromptError("the prompt is empty (no tokens to run)")
        if n >= ctx:
            raise PromptError(
                f"the prompt is {n} tokens but the context holds {ctx} (including at least one"
                " generated token): shorten the prompt or raise the context (--ctx)"
            )
        longest = min(ctx, n + (params.max_tokens or ctx))
        if longest > self.kv_tokens:
            raise RequestTooLargeError(
                f"the request can grow to {longest} tokens (prompt {n} + max_tokens) but the KV"
                f" cache holds {self.kv_tokens} tokens in all; lower max_tokens or raise"
                " --kv-budget / --parallel"
            )
        return Sequence(
            self.next_id(), prompt_ids, params, self.tokenizer, ctx, prompt, priority, request_id
        )

    def from_prompt(
        self, prompt: Prompt | Messages, params: SamplingParams | None = None, **kw
    ) -> Sequence:
        """A request for text, token ids, or a chat (a list of message dicts)."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            return self.make(self.chat_token_ids(prompt), params, **kw)
        text = prompt if isinstance(prompt, str) else None
        return self.make(self.encode(prompt), params, text, **kw)
