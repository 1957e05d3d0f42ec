"""`edgeinfer quantize SRC DST TYPE`: llama.cpp's quantizer, with progress and clean errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from edgeinfer.cli.options import Threads
from edgeinfer.eval.quantize import TYPES
from edgeinfer.units import human_bytes


def quantize(
    src: Annotated[Path, typer.Argument(help="Source GGUF: F32, F16 or BF16 weights.")],
    dst: Annotated[Path, typer.Argument(help="Output GGUF (written only if it all succeeds).")],
    qtype: Annotated[str, typer.Argument(metavar="TYPE", help=f"One of {', '.join(TYPES)}.")],
    threads: Threads = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite DST.")] = False,
    allow_requantize: Annotated[
        bool,
        typer.Option(
            "--allow-requantize", help="Accept an already quantized source (adds its error)."
        ),
    ] = False,
) -> None:
    """Quantize a model with llama.cpp's own quantizer (the same files llama.cpp makes).

    TYPE is a llama.cpp file type: the _S/_M/_L K-quant mixes give attention V, FFN down and the output head more bits than the rest, as llama-quantize does. Prints DST's size and bits per weight; judge the result with `edgeinfer eval DST --text FILE --reference SRC`.
    """  # noqa: E501
    from edgeinfer.eval.quantize import quantize as run

    tty = sys.stderr.isatty()

    def progress(i: int, n: int, name: str) -> None:
        if tty:
            print(f"\r[{i:4d}/{n}] {name:<48.48}", end="", file=sys.stderr, flush=True)

    try:
        q = run(src, dst, qtype, threads, force, allow_requantize, progress)
    finally:
        if tty:
            print(file=sys.stderr)
    typer.echo(
        f"{q.path}: {q.type}, {human_bytes(q.size)}, {q.bits_per_weight:.2f} bits per weight "
        f"(source {human_bytes(q.source_size)}, {q.source_bits_per_weight:.2f}); "
        f"tensors: {q.summary.split(';')[0]}"
    )
