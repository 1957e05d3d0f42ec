"""`edgeinfer serve`: an OpenAI-compatible HTTP server (edgeinfer/server/, design.md §7)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgeinfer.cli.options import (
    Ctx,
    GpuLayers,
    KVBudget,
    KVDtype,
    ModelArg,
    Offload,
    Parallel,
    Precision,
    Rpc,
    Spec,
    SpecK,
    Threads,
    kv_budget_bytes,
    offload_knobs,
    spec_knobs,
)
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.hub import DEFAULT_MODEL


def serve(
    model: ModelArg = DEFAULT_MODEL,
    host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8080,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            envvar="EDGEINFER_API_KEY",
            help="Accepted Bearer key (repeatable); every endpoint but /health then needs one.",
        ),
    ] = None,
    api_key_file: Annotated[
        str | None, typer.Option("--api-key-file", help="File of accepted keys, one a line.")
    ] = None,
    parallel: Parallel = 4,
    ctx: Ctx = None,
    kv_budget: KVBudget = None,
    kv_dtype: KVDtype = "f16",
    offload: Offload = None,
    gpu_layers: GpuLayers = None,
    rpc: Rpc = None,
    threads: Threads = None,
    max_num_seqs: Annotated[
        int, typer.Option("--max-num-seqs", help="Most sequences decoded in one step.")
    ] = 64,
    max_queue: Annotated[
        int | None,
        typer.Option("--max-queue", help="Sequences that may wait for a slot; more get 503."),
    ] = None,
    rate_limit: Annotated[
        str | None,
        typer.Option("--rate-limit", help="Requests per key (or client), e.g. 60/min; 429 past."),
    ] = None,
    max_body: Annotated[
        str, typer.Option("--max-body", help="Largest request body (413 past it), e.g. 4M.")
    ] = "4M",
    log_format: Annotated[
        str, typer.Option("--log-format", help="Request log lines as text or json.")
    ] = "text",
    log_prompts: Annotated[
        bool, typer.Option("--log-prompts", help="Include prompts in the request log.")
    ] = False,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option("--cors-origin", help="Origin allowed by CORS (repeatable; * = any)."),
    ] = None,
    batch_invariant: Annotated[
        bool,
        typer.Option(
            "--batch-invariant", help="Each request's tokens the same as run alone (slower)."
        ),
    ] = False,
    spec: Spec = None,
    spec_k: SpecK = None,
    precision: Precision = "fast",
    chat_template_file: Annotated[
        Path | None,
        typer.Option(
            "--chat-template-file",
            help="A Jinja chat template to use instead of the model's (as llama.cpp's).",
        ),
    ] = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, metrics)."""
    from edgeinfer.config import EngineConfig
    from edgeinfer.server.admission import parse_rate
    from edgeinfer.server.auth import read_key_file
    from edgeinfer.server.run import run
    from edgeinfer.server.settings import ServerSettings, model_name
    from edgeinfer.units import parse_bytes

    config = EngineConfig(
        threads=threads,
        ctx=ctx,
        parallel=parallel,
        kv_budget=kv_budget_bytes(kv_budget),
        kv_dtype=kv_dtype,
        **offload_knobs(offload, gpu_layers, rpc),
        max_num_seqs=max_num_seqs,
        batch_invariant=batch_invariant,
        precision=precision,
        **spec_knobs(spec, spec_k),
    )
    keys = list(api_key or []) + (read_key_file(api_key_file) if api_key_file else [])
    try:
        body_limit = parse_bytes(max_body)
    except ValueError as e:
        raise EdgeInferError(f"--max-body: {e}") from None
    rate, burst = (None, 1) if rate_limit is None else parse_rate(rate_limit)
    template = None if chat_template_file is None else read_template(chat_template_file)
    settings = ServerSettings(
        model=model,
        model_name=model_name(model),
        engine_kwargs={"config": config},
        host=host,
        port=port,
        api_keys=tuple(keys),
        max_queue=max_queue,
        rate_per_s=rate,
        rate_burst=burst,
        max_body=body_limit,
        log_format=log_format,
        log_prompts=log_prompts,
        cors_origins=tuple(cors_origin or ()),
        chat_template=template,
    )
    run(settings)


def read_template(path: Path) -> str:
    """A template file's text, compiled once here so that a bad one stops the start."""
    from edgeinfer.tokenizer.chat_template import ChatTemplate

    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EdgeInferError(f"--chat-template-file: cannot read {path}: {e}") from None
    try:
        ChatTemplate(source)
    except EdgeInferError as e:
        raise EdgeInferError(f"--chat-template-file {path}: {e}") from None
    return source
