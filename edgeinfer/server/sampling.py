"""A request's fields -> one `SamplingParams` per choice.

Fields left out take the engine's defaults (llama.cpp's: temperature 0.8, top-k 40, top-p
0.95, min-p 0.05), as llama.cpp's server and llama-cpp-python's do. `logit_bias` and
`response_format` become logits processors, the engine's hook for per-request logit edits.
"""

from __future__ import annotations

import numpy as np

from edgeinfer.engine.sampling import SamplingParams, SamplingParamsError
from edgeinfer.server.errors import bad_request
from edgeinfer.server.grammar import Grammar
from edgeinfer.server.protocol import _Sampling

_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "spec_k",
)


class LogitBias:
    """OpenAI's logit_bias: a value in [-100, 100] added to a token's logit before sampling
    (-100 bans it in practice, 100 all but forces it)."""

    def __init__(self, bias: dict[str, float], vocab_size: int):
        ids, values = [], []
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            if not 0 <= token < vocab_size:
                raise bad_request(
                    f"logit_bias token {token} is outside the vocabulary [0, {vocab_size})",
                    "logit_bias",
                )
            ids.append(token)
            values.append(value)
        self.ids = np.asarray(ids, dtype=np.int64)
        self.values = np.asarray(values, dtype=np.float32)

    def __call__(self, output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        # logits: [vocab] float32, edited in place
        logits[self.ids] += self.values
        return logits


def choice_params(
    req: _Sampling, index: int, vocab_size: int, grammar: Grammar | None
) -> SamplingParams:
    """The SamplingParams of choice `index` (choices differ only in seed and grammar state)."""
    fields = {name: getattr(req, name) for name in _FIELDS if getattr(req, name) is not None}
    processors = []
    if req.logit_bias:
        processors.append(LogitBias(req.logit_bias, vocab_size))
    if grammar is not None:
        processors.append(grammar.processor())  # per choice: a matcher holds its parse state
    seed = None if req.seed is None else (req.seed + index) % 2**64
    try:
        return SamplingParams(
            **fields,
            seed=seed,
            stop=req.stop,
            max_tokens=req.limit,
            ignore_eos=req.ignore_eos,
            logprobs=req.num_logprobs,
            logits_processors=tuple(processors),
        )
    except SamplingParamsError as e:
        raise bad_request(str(e)) from None
