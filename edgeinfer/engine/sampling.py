"""Sampling parameters and the sampler that turns one position's logits into a token id.

The chain is llama.cpp's default (common/sampling.cpp): penalties -> top-k -> top-p -> min-p ->
temperature -> draw. Note that top-p and min-p see the logits *before* temperature, as in
llama.cpp (vLLM scales first); temperature only reshapes the distribution over the survivors.
The sampler is pure numpy on a float32 logits vector plus the token history, so it is the same
whichever executor produced the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edgeinfer.errors import EdgeInferError

_TOP_P_TRIES = (256, 16384, 1 << 62)
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
_DRAW_BLOCK = 1024


class SamplingParamsError(EdgeInferError, ValueError):
    """A sampling parameter outside its valid range."""


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults are llama.cpp's (`llama-cli`, `llama-server`).

    temperature: 0 = greedy (argmax after penalties). top_k: 0 or -1 = off. top_p: 1 = off.
    min_p: 0 = off. repetition_penalty: 1 = off; presence/frequency_penalty: 0 = off; all three
    look at the last `repeat_last_n` tokens of prompt + output, as llama.cpp does (0 = off,
    -1 = the whole history). seed: None = fresh entropy per request; an int makes the request
    reproducible. stop: strings that end generation (excluded from the text). stop_token_ids:
    extra ids that end generation like EOS. max_tokens: None = until EOS, a stop, or the context
    is full. ignore_eos: keep going past the model's end-of-generation tokens.
    logprobs: None = off; k in 0..20 reports each generated token's log-probability and the k
    most likely tokens, from the log-softmax of the model's raw logits (before any processor or
    penalty, as OpenAI and vLLM report them). logits_processors: vLLM's hook, each called as
    fn(output_token_ids, logits[vocab]) -> logits before the penalties (logit bias, grammars).
    spec_k: speculative decoding's draft tokens a step for this request where the engine
    speculates (`speculative`): None = the engine's spec_k, 0 = no drafts (a request whose
    guesses rarely hold, e.g. sampled at a high temperature), k = at most k; ignored otherwise.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    logits_processors: tuple[Callable[[list[int], np.ndarray], np.ndarray], ...] = ()
    spec_k: int | None = None

    def __post_init__(self):
        def bad(name, rule):
            raise SamplingParamsError(f"{name} must be {rule} (got {getattr(self, name)!r})")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                bad(name, "a finite number")
        if self.temperature < 0:
            bad("temperature", ">= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "an integer >= -1 (0 or -1 = disabled)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "> 0 (1 = disabled)")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            bad("repeat_last_n", "an integer >= -1 (0 = disabled, -1 = whole history)")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            bad("seed", "None or an integer >= 0")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "None or an integer >= 1")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "a bool")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.spec_k is not None and (not _is_int(self.spec_k) or self.spec_k < 0):
            bad("spec_k", "None or an integer >= 0 (0 = no drafts)")
        processors = tuple(self.logits_processors)
        if not all(callable(f) for f in processors):
            bad("logits_processors", "a list of callables")
        object.__setattr__(self, "logits_processors", processors)

        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", "a non-empty string or a list of non-empty strings")
        ids = tuple(self.stop_token_ids or ())
        if not all(_is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids", "a list of token ids >= 0")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's penalties sampler over the last `repeat_last_n` tokens of history.

    # logits: [vocab] float32, history: token ids (prompt + output) -> [vocab] float32 (a copy)
    A repeated token's logit is divided by repetition_penalty when positive and multiplied when
    not (so a penalty always makes it less likely), then count * frequency + presence is taken off.
    """
    if not p.penalized or len(history) == 0:
        return logits
    window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n :]
    toks, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    keep = (toks >= 0) & (toks < logits.shape[0])
    toks, counts = toks[keep], counts[keep]
    out = np.array(logits, dtype=np.float32)
    v = out[toks]
    rp = np.float32(p.repetition_penalty)
    v = np.where(v <= 0, v * rp, v / rp)
    v -= counts.astype(np.float32) * np.float32(p.frequency_penalty) + np.float32(
        p.presence_penalty
    )
    out[toks] = v
    return out


def _sorted_best(vals: np.ndarray, m: int) -> np.ndarray:
    """Positions of the m largest values, largest first."""
    if m < vals.size:
        part = np.argpartition(-vals, m - 1)[:m]
        return part[np.argsort(-vals[part])]
    return np.argsort(-vals)


def candidates(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Token ids that top-k, then top-p, then min-p let through (llama.cpp's definitions).

    # logits: [vocab] float32 (already penalized) -> [n] int64 ids
    top-p keeps the smallest most-likely prefix whose probability (softmax over the top-k
    survivors) reaches p; min-p keeps tokens with prob >= min_p * max prob. Both cut a prefix of
    the sorted order and the max survives both, so min-p can be applied first as a cheap
    threshold without changing the result: only top-p's normaliser must come from the top-k set.
    """
    n = logits.shape[0]
    mx = logits.max()
    if 0 < p.top_k < n:
        ids = np.argpartition(logits, n - p.top_k)[n - p.top_k :]
    else:
        ids = np.arange(n)
    vals = logits[ids]
    if p.top_p < 1:
        z = np.exp(vals - mx).sum(dtype=np.float64)
    if p.min_p > 0:
        keep = vals >= mx + np.float32(math.log(p.min_p))
        ids, vals = ids[keep], vals[keep]
    if p.top_p >= 1:
        return ids
    # sorting a 262k vocabulary costs tens of ms: like llama.cpp, sort the best few first and
    # only widen when they do not reach p
    for m in _TOP_P_TRIES:
        m = min(m, ids.size)
        order = _sorted_best(vals, m)
        cum = np.cumsum(np.exp(vals[order] - mx), dtype=np.float64) / z
        cut = int(np.searchsorted(cum, p.top_p, side="left"))
        if cut < m or m == ids.size:
            return ids[order[: min(cut + 1, m)]]
    raise AssertionError("unreachable: the last try covers every candidate")


def draw(w: np.ndarray, u: float) -> int:
    """Index i with probability w[i] / sum(w), for a uniform draw u in [0, 1).

    # w: [n] float32 weights >= 0, w.max() > 0 -> index
    The first index whose running sum passes u * total, as llama.cpp's dist sampler, summed in
    float64 in two levels (block sums, then one block): numpy's cumsum over a 262k vocabulary
    is ~10x slower than a reduction.
    """
    starts = np.arange(0, w.shape[0], _DRAW_BLOCK)
    bcum = np.cumsum(np.add.reduceat(w, starts, dtype=np.float64))
    target = u * bcum[-1]
    # side="right": a block or token of weight 0 (underflowed) can never be chosen
    b = min(int(np.searchsorted(bcum, target, side="right")), bcum.shape[0] - 1)
    inner = np.cumsum(w[starts[b] : starts[b] + _DRAW_BLOCK], dtype=np.float64)
    rest = target - (bcum[b - 1] if b else 0.0)
    return int(starts[b]) + min(int(np.searchsorted(inner, rest, side="right")), inner.shape[0] - 1)


class Sampler:
    """Per-request sampler: the params plus the request's own random generator (its seed)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int], num_prompt: int = 0) -> int:
        """# logits: [vocab] float32, history: prompt + output ids so far (the first
        num_prompt of them the prompt) -> next token id"""
        logits = self._process(logits, history, num_prompt)
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, w = self._weights(logits)
        return int(ids[draw(w, self.rng.random())])

    def verify(
        self, logits: np.ndarray, history: Sequence[int], num_prompt: int, guess: int
    ) -> tuple[int, bool]:
        """Speculative decoding's rejection sampling for a draft that proposed `guess` with
        certainty (a point mass q): -> (the token to append, whether it is the guess).

        Greedy: the argmax, accepted when it is the guess. Otherwise the guess is kept with
        probability p(guess); on rejection the token is drawn from max(0, p - q) renormalised,
        i.e. p without the guess. Either way the token is distributed exactly as __call__'s.
        """
        logits = self._process(logits, history, num_prompt)
        if self.params.greedy:
            token = int(np.argmax(logits))
            return token, token == guess
        ids, w = self._weights(logits)
        at = np.flatnonzero(ids == guess)
        if at.size:
            total = w.sum(dtype=np.float64)
            if self.rng.random() * total < w[at[0]]:
                return guess, True
            w[at[0]] = 0
        return int(ids[draw(w, self.rng.random())]), False

    def _process(self, logits: np.ndarray, history: Sequence[int], num_prompt: int) -> np.ndarray:
        """The logits processors, then the penalties."""
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.logits_processors:
            output = list(history[num_prompt:])
            logits = logits.copy()  # processors may write in place: the caller's row stays
            for process in p.logits_processors:
                logits = np.asarray(process(output, logits), dtype=np.float32)
        return apply_penalties(logits, history, p)

    def _weights(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> (candidate ids, their unnormalised probabilities after temperature)"""
        ids = candidates(logits, self.params)
        vals = logits[ids]
        return ids, np.exp((vals - vals.max()) / np.float32(self.params.temperature))


def top_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """# logits: [vocab] float32 -> (log p(token), the k most likely (id, log p), best first),
    from a float64 log-softmax."""
    x = logits.astype(np.float64)
    x -= x.max()
    lp = x - math.log(np.exp(x).sum())
    best = _sorted_best(lp, k) if k else np.empty(0, np.int64)
    return float(lp[token]), [(int(i), float(lp[i])) for i in best]
