"""Perplexity over windows of a tokenized text, with llama-perplexity's rules.

The text is tokenized once (BOS first when the model's metadata adds one) and cut into
consecutive, non-overlapping windows of n_ctx tokens from its first token; a trailing part
shorter than a window is left out. Each window is evaluated alone from an empty cache, its first
token replaced by BOS when the model adds one, and only its second half is scored: the logits at
positions n_ctx/2 .. n_ctx-2 predict tokens n_ctx/2+1 .. n_ctx-1 (n_ctx - 1 - n_ctx/2 tokens a
window), so every scored token has at least n_ctx/2 tokens of context.

Windows stream through the engine one at a time (`Engine.forward` then `release`, float
activations): memory holds one window's logits, never the text's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.eval import stats
from edgeinfer.eval.logits_file import RANGE, LogitsReader, LogitsWriter, scored_rows


@dataclass
class Progress:
    window: int  # 1-based, of `windows`
    windows: int
    perplexity: float  # so far
    tokens_per_s: float  # evaluated tokens per second of forward passes, so far


@dataclass
class Result:
    summary: dict  # stats.Totals.summary() plus the run's shape and speed

    @property
    def perplexity(self) -> float:
        return self.summary["perplexity"]


def count_windows(n_tokens: int, n_ctx: int, chunks: int | None) -> int:
    n = n_tokens // n_ctx
    return n if chunks is None else min(chunks, n)


def window(tokens: np.ndarray, i: int, n_ctx: int, bos: int | None) -> np.ndarray:
    """Window i's tokens as evaluated: BOS in place of its first token when the model adds one."""
    w = np.array(tokens[i * n_ctx : (i + 1) * n_ctx], dtype=np.int64)
    if bos is not None:
        w[0] = bos
    return w


def forward(llm, ids: np.ndarray) -> np.ndarray:
    """One window through `llm`'s engine from an empty sequence -> float32[n, vocab]."""
    seq_id = llm.requests.next_id()
    try:
        return llm.engine.forward(seq_id, ids.tolist())
    finally:
        llm.engine.release(seq_id)


def _bos(llm) -> int | None:
    tok = llm.tokenizer
    return tok.bos_id if tok.add_bos and tok.bos_id is not None else None


def evaluate(
    llm,
    tokens: np.ndarray,
    n_ctx: int,
    chunks: int | None = None,
    reference=None,
    save_logits: str | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> Result:
    """Perplexity of `llm` (an edgeinfer.LLM) over the windows of `tokens`.

    reference: another LLM of the same vocabulary (run on the same windows), or a LogitsReader
    of saved log-probabilities (its tokens must start `tokens`): adds KL divergence, top-1
    agreement and Δp. save_logits: a path to write llama-perplexity's log-prob file to.
    """
    vocab = llm.config.vocab_size
    if n_ctx < 4:
        raise EdgeInferError(f"--ctx must be >= 4 (got {n_ctx})")
    if n_ctx > llm.max_context:
        raise EdgeInferError(f"--ctx {n_ctx} exceeds the model's context {llm.max_context}")
    if chunks is not None and chunks < 1:
        raise EdgeInferError(f"--chunks must be >= 1 (got {chunks})")
    if len(tokens) < n_ctx:
        raise EdgeInferError(
            f"the text tokenizes to {len(tokens)} tokens; --ctx {n_ctx} needs at least {n_ctx}"
        )
    if isinstance(reference, LogitsReader):
        _check_saved(reference, tokens, n_ctx, vocab)
        n_windows = count_windows(reference.n_chunk * n_ctx, n_ctx, chunks)
    else:
        if reference is not None and reference.config.vocab_size != vocab:
            raise EdgeInferError(
                f"--reference has a vocabulary of {reference.config.vocab_size} tokens, "
                f"the model {vocab}: not the same model"
            )
        n_windows = count_windows(len(tokens), n_ctx, chunks)
    bos = _bos(llm)
    first = n_ctx // 2
    writer = None
    if save_logits is not None:
        writer = LogitsWriter(save_logits, n_ctx, vocab, tokens[: n_windows * n_ctx])
    totals = stats.Totals()
    forward_s = 0.0
    t0 = time.perf_counter()
    try:
        for i in range(n_windows):
            ids = window(tokens, i, n_ctx, bos)
            targets = ids[first + 1 :]  # BOS, at 0, is never a target
            t = time.perf_counter()
            logits = forward(llm, ids)[first : n_ctx - 1]
            forward_s += time.perf_counter() - t
            s = stats.score(logits, targets)
            if writer is not None:
                writer.write(logits)
            if reference is None:
                totals.add(s)
            else:
                base_logits, base_lse, floor = _reference_rows(reference, ids, i, first, n_ctx)
                base = _base_scores(base_logits, base_lse, targets)
                kld = stats.kl_rows(base_logits, base_lse, logits, s.lse, floor)
                totals.add(s, base, kld)
            del logits
            if progress is not None:
                ppl, _ = totals.perplexity()
                done = (i + 1) * n_ctx
                progress(Progress(i + 1, n_windows, ppl, done / forward_s if forward_s else 0))
    finally:
        if writer is not None:
            writer.close()
    elapsed = time.perf_counter() - t0
    summary = {
        "ctx": n_ctx,
        "windows": n_windows,
        "scored_per_window": scored_rows(n_ctx),
        **totals.summary(),
        "seconds": elapsed,
        "forward_seconds": forward_s,
        "forward_tokens_per_s": n_windows * n_ctx / forward_s if forward_s else 0.0,
    }
    return Result(summary)


def _reference_rows(reference, ids, i: int, first: int, n_ctx: int):
    """The reference's scored rows -> (float32[m, V] logits or log-probs, float64[m] lse, the
    log-prob at or below which KL leaves a token out)."""
    if isinstance(reference, LogitsReader):
        lp = reference.log_probs(i)
        return lp, np.zeros(lp.shape[0]), -RANGE  # llama.cpp's rule for its own files
    base = forward(reference, ids)[first : n_ctx - 1]
    lse = stats.score(base, np.zeros(len(base), np.int64)).lse
    return base, lse, -math.inf


def _base_scores(base: np.ndarray, base_lse: np.ndarray, targets: np.ndarray) -> stats.Scores:
    rows = np.arange(len(targets))
    nll = base_lse - base[rows, targets].astype(np.float64)
    return stats.Scores(nll, base.argmax(axis=1).astype(np.int64), base_lse)


def _check_saved(reader: LogitsReader, tokens: np.ndarray, n_ctx: int, vocab: int) -> None:
    if reader.n_ctx != n_ctx:
        raise EdgeInferError(f"{reader.path} was saved with --ctx {reader.n_ctx}, not {n_ctx}")
    if reader.n_vocab != vocab:
        raise EdgeInferError(
            f"{reader.path} has a vocabulary of {reader.n_vocab} tokens, the model {vocab}"
        )
    saved = reader.tokens
    n = min(len(saved), len(tokens))
    if n < len(saved) or not np.array_equal(saved, tokens[:n]):
        raise EdgeInferError(
            f"{reader.path}: its tokens are not this text's (another text or tokenizer)"
        )
