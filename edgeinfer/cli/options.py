"""Options shared by the generating commands (`run`, `chat`), so their flags cannot drift apart."""

from __future__ import annotations

from typing import Annotated

import typer

from edgeinfer.errors import EdgeInferError

ModelArg = Annotated[
    str, typer.Argument(help="GGUF path or short model name (pulled on first use).")
]
Threads = Annotated[int | None, typer.Option("--threads", "-t", help="CPU threads.")]
Ctx = Annotated[int | None, typer.Option("--ctx", "-c", help="Context length.")]
Temp = Annotated[float, typer.Option("--temp", help="Temperature; 0 = greedy.")]
TopK = Annotated[int, typer.Option("--top-k", help="0 = disabled.")]
TopP = Annotated[float, typer.Option("--top-p", help="1 = disabled.")]
MinP = Annotated[float, typer.Option("--min-p", help="0 = disabled.")]
Seed = Annotated[int | None, typer.Option("--seed", help="Fixed seed: same output.")]
Parallel = Annotated[
    int, typer.Option("--parallel", help="KV cache for this many sequences of --ctx tokens.")
]
Precision = Annotated[
    str,
    typer.Option(
        "--precision",
        help="fast: prompts run an integer GEMM on K-quant weights, activations rounded to int8 "
        "blocks as llama.cpp does; exact: float activations everywhere (closest to exact math, "
        "slower prompts).",
    ),
]
KVBudget = Annotated[
    str | None,
    typer.Option("--kv-budget", help="KV cache size instead of ctx x parallel, e.g. 512M, 2G."),
]
KVDtype = Annotated[
    str,
    typer.Option(
        "--kv-dtype",
        help="KV cache type (llama.cpp's -ctk/-ctv): f16, f32, q8_0 (8-bit blocks of 32: 53 % "
        "of f16's bytes, about twice the context in the same memory) or q4_0 (4-bit blocks: 28 "
        "%, less accurate).",
    ),
]
Spec = Annotated[
    str | None,
    typer.Option(
        "--spec",
        help="Speculative decoding: 'ngram' drafts tokens by looking the last few up in the "
        "prompt and output so far (fast on text that copies: code edits, quotes); "
        "'draft:MODEL' has a smaller GGUF with the same vocabulary guess them. Greedy output "
        "is unchanged.",
    ),
]
SpecK = Annotated[
    int | None,
    typer.Option("--spec-k", help="With --spec: most draft tokens per step (adapts below it)."),
]


def spec_knobs(spec: str | None, spec_k: int | None) -> dict:
    """--spec / --spec-k as EngineConfig knobs (spec_k keeps its default when not given)."""
    return {"speculative": spec} | ({} if spec_k is None else {"spec_k": spec_k})


def kv_budget_bytes(text: str | None) -> int | None:
    from edgeinfer.units import parse_bytes

    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise EdgeInferError(f"--kv-budget: {e}") from None


def max_tokens_limit(max_tokens: int) -> int | None:
    """-n/--max-tokens as SamplingParams wants it: -1, "no limit", becomes None."""
    if max_tokens == 0 or max_tokens < -1:
        raise EdgeInferError(f"-n/--max-tokens must be >= 1 or -1 (got {max_tokens})")
    return None if max_tokens == -1 else max_tokens


Offload = Annotated[
    str | None,
    typer.Option(
        "--offload",
        help="Run a span of layers through llama.cpp's ggml backend: LAYERS@BACKEND, e.g. "
        "12-29@cuda:0, 0-5@cpu, 20-29+head@cuda (the output head too), all@cuda. BACKEND: cpu "
        "(ggml's CPU kernels), cuda[:N] (build it with `make cuda`) or rpc:HOST:PORT (a ggml "
        "RPC server, `edgeinfer rpc-server`). Several spans, comma-separated, must follow one "
        "another: 8-15@rpc:10.0.0.2:50052,16-23+head@rpc:10.0.0.3:50052.",
    ),
]
GpuLayers = Annotated[
    int | None,
    typer.Option(
        "--gpu-layers",
        help="llama.cpp's -ngl: the last N layers on the GPU (cuda), the output head too when N "
        "covers every layer.",
    ),
]


Rpc = Annotated[
    str | None,
    typer.Option(
        "--rpc",
        help="ggml RPC servers on other machines, HOST:PORT[,HOST:PORT...] (`edgeinfer "
        "rpc-server` there; trusted network only: no authentication, no encryption). Without "
        "--offload every layer and the head (or the last --gpu-layers N layers) are split among "
        "them in proportion to each one's free memory; their KV cache lives there too.",
    ),
]


def offload_knobs(offload: str | None, gpu_layers: int | None, rpc: str | None = None) -> dict:
    """--offload / --gpu-layers / --rpc as EngineConfig knobs (none when none is given)."""
    knobs = (("offload", offload), ("gpu_layers", gpu_layers), ("rpc", rpc))
    return {k: v for k, v in knobs if v is not None}
