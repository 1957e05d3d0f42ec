"""`edgeinfer eval`: perplexity (and KL divergence against a reference) over a text, or the
per-tensor error between two files of one model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from edgeinfer.cli.options import Precision, Threads
from edgeinfer.errors import EdgeInferError


def eval_(
    model: Annotated[
        str | None, typer.Argument(help="GGUF path or short model name to evaluate.")
    ] = None,
    text: Annotated[
        Path | None, typer.Option("--text", help="UTF-8 text file to compute perplexity on.")
    ] = None,
    reference: Annotated[
        str | None,
        typer.Option(
            "--reference",
            help="A higher-precision GGUF of the same model (run here, on the same windows), "
            "or a file saved with --save-logits (or by llama-perplexity "
            "--kl-divergence-base): adds KL divergence, top-1 agreement and delta-p.",
        ),
    ] = None,
    ctx: Annotated[
        int | None,
        typer.Option(
            "--ctx", "-c", help="Window length in tokens (default 512, or the saved file's)."
        ),
    ] = None,
    chunks: Annotated[
        int | None, typer.Option("--chunks", help="Evaluate only the first N windows.")
    ] = None,
    save_logits: Annotated[
        Path | None,
        typer.Option(
            "--save-logits",
            help="Write MODEL's log-probabilities of the scored tokens (llama-perplexity's "
            "format; ~2 bytes x vocabulary per token) to use later as --reference.",
        ),
    ] = None,
    weights: Annotated[
        tuple[str, str] | None,
        typer.Option(
            "--weights",
            metavar="A B",
            help="Compare the weights of two files of one model instead (B the reference): "
            "per-tensor NMSE and max error, worst first, and each file's bits per weight.",
        ),
    ] = None,
    threads: Threads = None,
    precision: Precision = "fast",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Perplexity of MODEL over a text, as llama.cpp's llama-perplexity computes it.

    The text is tokenized once (BOS first if the model adds one) and cut into consecutive, non-overlapping windows of --ctx tokens from its first token (a shorter tail is left out). Each window runs alone, its first token replaced by BOS when the model adds one, and only its second half is scored: the logits at positions ctx/2 .. ctx-2 predict the tokens after them, ctx - 1 - ctx/2 tokens a window. PPL = exp(mean negative log-likelihood), with its standard error. The windows run as prompts do (--precision fast: int8 activations, as llama.cpp's; exact: float); a --reference model always runs exact.

    With --reference, the report adds llama-perplexity --kl-divergence's statistics, line for line: PPL(Q) against PPL(base), KL(base || Q) (mean, percentiles), delta-p of the true token and top-1 agreement. `--weights A B` compares two files' weights instead.
    """  # noqa: E501
    if weights is not None:
        if model is not None or text is not None or reference is not None:
            raise EdgeInferError("--weights A B takes no MODEL, --text or --reference")
        return _weights(weights, json_out)
    if model is None:
        raise EdgeInferError("no model: pass MODEL (or --weights A B)")
    _perplexity(model, text, reference, ctx, chunks, save_logits, threads, precision, json_out)


def _perplexity(
    model, text, reference, ctx, chunks, save_logits, threads, precision, json_out
) -> None:
    import numpy as np

    from edgeinfer.eval import stats, windows
    from edgeinfer.eval.logits_file import MAGIC, LogitsReader
    from edgeinfer.gguf.hub import resolve_model
    from edgeinfer.llm import LLM

    saved = None
    if reference is not None:
        ref_path = resolve_model(reference)
        with open(ref_path, "rb") as f:
            if f.read(len(MAGIC)) == MAGIC:
                saved = LogitsReader(ref_path)
    if text is None and saved is None:
        raise EdgeInferError("no text: pass --text FILE")
    if ctx is None:
        ctx = saved.n_ctx if saved is not None else 512
    if chunks is not None and chunks < 1:
        raise EdgeInferError(f"--chunks must be >= 1 (got {chunks})")
    content = _read_text(text) if text is not None else None
    llm = LLM(model, threads=threads, ctx=ctx, parallel=1, precision=precision)
    if content is not None:
        tokens = np.array(llm.tokenizer.encode(content), dtype=np.int64)
    else:
        tokens = saved.tokens
    ref = saved
    if reference is not None and saved is None:
        ref = LLM(reference, threads=threads, ctx=ctx, parallel=1, precision="exact")
    tty = sys.stderr.isatty()

    def progress(p: windows.Progress) -> None:
        line = f"[{p.window}/{p.windows}] PPL {p.perplexity:.4f}, {p.tokens_per_s:.0f} tok/s"
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    try:
        result = windows.evaluate(llm, tokens, ctx, chunks, ref, save_logits, progress)
    finally:
        if tty:
            print(file=sys.stderr)
    s = result.summary
    if json_out:
        out = {"model": model, "text": str(text) if text else None, "reference": reference}
        print(json.dumps({**out, **s}))
        return
    print(
        f"{model}: {s['windows']} windows of {ctx} tokens, {s['tokens']} scored; "
        f"{s['seconds']:.1f} s, {s['forward_tokens_per_s']:.0f} tok/s in forward passes"
    )
    print(stats.report(s))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EdgeInferError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _weights(paths: tuple[str, str], json_out: bool) -> None:
    from edgeinfer.eval import weights
    from edgeinfer.gguf.hub import resolve_model

    a, b = (resolve_model(p) for p in paths)
    tty = sys.stderr.isatty()

    def progress(i: int, n: int, name: str) -> None:
        if tty:
            print(f"\r[{i:4d}/{n}] {name:<48.48}", end="", file=sys.stderr, flush=True)

    try:
        errors, ga, gb = weights.compare(a, b, progress)
    finally:
        if tty:
            print(file=sys.stderr)
    total = weights.total_nmse(errors, ga)
    files = {
        "a": {"path": str(a), "bits_per_weight": weights.bits_per_weight(ga),
              "types": weights.type_counts(ga)},
        "b": {"path": str(b), "bits_per_weight": weights.bits_per_weight(gb),
              "types": weights.type_counts(gb)},
    }  # fmt: skip
    if json_out:
        print(json.dumps({**files, "nmse": total, "tensors": [e.as_dict() for e in errors]}))
        return
    width = max(len(e.name) for e in errors)
    print(f"{'tensor':<{width}}  {'shape':>14}  {'A':>5}  {'B':>5}  {'NMSE':>9}  {'max err':>9}")
    for e in errors:
        shape = "x".join(str(d) for d in e.shape)
        print(
            f"{e.name:<{width}}  {shape:>14}  {e.type_a:>5}  {e.type_b:>5}  "
            f"{e.nmse:9.3e}  {e.max_error:9.3e}"
        )
    print(f"A {a}: {weights.describe(ga)}")
    print(f"B {b}: {weights.describe(gb)}")
    print(f"all weights: NMSE {total:.3e} (each tensor weighted by its size)")
