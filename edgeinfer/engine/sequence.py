"""One request's state: its tokens, sampler, streamed text, stop state and timings.

The engine drives every request the same way: it computes the K/V of `token_ids` past
`num_computed` (in one or several steps), then `token = seq.sample(logits)`,
`delta = seq.append(token)`, until `seq.finished`; the KV cache is addressed by `seq.seq_id`.
With speculative decoding a step verifies draft tokens instead: `tokens = seq.verify(rows,
draft)`, `delta = seq.extend(tokens)`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from time import perf_counter

from edgeinfer.engine.outputs import TokenLogprob
from edgeinfer.engine.sampling import Sampler, SamplingParams, top_logprobs
from edgeinfer.engine.stop import StopStrings


class Sequence:
    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        tokenizer,
        max_context: int,
        prompt: str | None = None,
        priority: int = 0,
        request_id: str | None = None,
    ):
        self.seq_id = seq_id
        self.arrival = seq_id  # ids are handed out in arrival order
        self.priority = priority
        self.request_id = request_id if request_id is not None else str(seq_id)
        self.prompt = prompt
        self.params = params
        self.max_context = max_context
        self.token_ids = list(prompt_token_ids)  # prompt + output: the penalties' history
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed = 0  # leading token_ids whose K/V are in the cache (set by the engine)
        self.num_cached_tokens = 0  # prompt tokens reused from the prefix cache at admission
        self.text = ""
        self.finish_reason: str | None = None  # 'stop' | 'length' | 'abort' (cancelled)
        # Set by another thread (Stream.cancel) and read by the loop before each forward step;
        # a bool assignment is atomic, so no lock is needed.
        self.aborted = False
        # per output token, when params.logprobs is set
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self._sampler = Sampler(params)
        self._decoder = tokenizer.stream_decoder()
        self._stop = StopStrings(params.stop)
        eos = frozenset() if params.ignore_eos else frozenset(tokenizer.eos_ids)
        self._end_ids = eos | frozenset(params.stop_token_ids)
        self._shown = 0  # len of self.text already handed out as deltas
        self.t_arrival = perf_counter()
        self.t_scheduled: float | None = None  # set by the engine when its prefill starts
        self.t_first_token: float | None = None
        self.t_last_token: float | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def sample(self, logits) -> int:
        """# logits: [vocab] float32 for the position after the last token -> next token id"""
        token = self._sampler(logits, self.token_ids, self.num_prompt_tokens)
        self._log(logits, token)
        return token

    def verify(self, rows, draft: list[int]) -> list[int]:
        """# rows: [1 + len(draft), vocab] float32, the logits after the last token and after
        each draft token -> the accepted drafts and one token more: each sampled exactly as
        `sample` would after the tokens before it (penalties and processors see them)."""
        out = []
        for row, guess in zip(rows[: len(draft)], draft, strict=True):
            token, accepted = self._sampler.verify(
                row, self.token_ids + out, self.num_prompt_tokens, guess
            )
            self._log(row, token)
            out.append(token)
            if not accepted:
                return out
        token = self._sampler(rows[len(draft)], self.token_ids + out, self.num_prompt_tokens)
        self._log(rows[len(draft)], token)
        return out + [token]

    def extend(self, tokens: list[int]) -> str:
        """Append tokens until one ends the sequence (the rest are dropped, as if never
        sampled) -> the text that became safe to show."""
        delta = ""
        for i, token in enumerate(tokens):
            delta += self.append(token)
            if self.finished:
                if self.logprobs is not None:
                    del self.logprobs[len(self.logprobs) - len(tokens) + i + 1 :]
                break
        return delta

    def _log(self, row, token: int) -> None:
        if self.logprobs is not None:
            logprob, top = top_logprobs(row, token, self.params.logprobs)
            self.logprobs.append(TokenLogprob(token, logprob, top))

    def append(self, token: int) -> str:
        """Add a generated token; return the text that became safe to show (may be empty)."""
        now = perf_counter()
        if self.t_first_token is None:
            self.t_first_token = now
        self.t_last_token = now
        self.token_ids.append(token)
        grown_from = len(self.text)
        if token in self._end_ids:
            self.finish_reason = "stop"
        else:
            self.text += self._decoder.push(token)
            if (
                self.num_output_tokens == self.params.max_tokens
                or len(self.token_ids) >= self.max_context
            ):
                self.finish_reason = "length"
        if self.finished:  # an unfinished UTF-8 character left at the end becomes U+FFFD
            self.text += self._decoder.flush()
        cut = self._stop.find(self.text, grown_from) if self.params.stop else -1
        if cut >= 0:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
        end = len(self.text) if self.finished else self._stop.safe_len(self.text)
        delta = self.text[self._shown : end]
        self._shown = end
        return delta
