"""What a finished request returns: its text, tokens, why it stopped, and how fast it ran."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeinfer.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Metrics:
    """Per-request timings (seconds, wall clock), as Ollama's --verbose reports them.

    ttft_s runs from the request's arrival to its first token (so it includes queueing and
    prefill); prefill covers the prompt's forward pass and the first sample; decode covers every
    later token (generated_tokens - 1 steps), so decode_tok_s is None for a one-token reply.
    """

    prompt_tokens: int
    cached_tokens: int  # of the prompt tokens, those reused from the prefix cache
    generated_tokens: int
    ttft_s: float
    prefill_s: float
    prefill_tok_s: float
    decode_s: float
    decode_tok_s: float | None

    @classmethod
    def from_sequence(cls, seq: Sequence) -> Metrics:
        prefill_s = seq.t_first_token - seq.t_scheduled
        decode_s = seq.t_last_token - seq.t_first_token
        steps = seq.num_output_tokens - 1
        return cls(
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            generated_tokens=seq.num_output_tokens,
            ttft_s=seq.t_first_token - seq.t_arrival,
            prefill_s=prefill_s,
            prefill_tok_s=seq.num_prompt_tokens / prefill_s if prefill_s > 0 else float("inf"),
            decode_s=decode_s,
            decode_tok_s=steps / decode_s if steps > 0 and decode_s > 0 else None,
        )

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line for humans (the `run` command prints it on stderr)."""
        decode = "n/a" if self.decode_tok_s is None else f"{self.decode_tok_s:.1f} tok/s"
        return (
            f"prompt {self.prompt_tokens} tok, prefill {self.prefill_tok_s:.1f} tok/s"
            f" | TTFT {self.ttft_s * 1000:.0f} ms"
            f" | generated {self.generated_tokens} tok, decode {decode}"
        )


@dataclass(frozen=True)
class Completion:
    """One prompt's result. token_ids include the token that ended generation (EOS or a stop
    token id), text does not, nor any stop string."""

    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    # 'stop' (EOS, stop token or stop string) | 'length' (max_tokens, context) | 'abort' (cancelled)
    finish_reason: str
    metrics: Metrics
    logprobs: list[TokenLogprob] | None = None  # one per token id, when params.logprobs is set

    @classmethod
    def from_sequence(cls, seq: Sequence) -> Completion:
        return cls(
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            metrics=Metrics.from_sequence(seq),
            logprobs=seq.logprobs,
        )

    def as_dict(self) -> dict:
        return asdict(self)
