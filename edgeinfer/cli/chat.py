"""`edgeinfer chat`: the terminal chat app (Textual), on the default model unless told otherwise."""

from __future__ import annotations

from typing import Annotated

import typer

from edgeinfer.cli.options import (
    Ctx,
    GpuLayers,
    KVDtype,
    MinP,
    ModelArg,
    Offload,
    Precision,
    Rpc,
    Seed,
    Spec,
    SpecK,
    Temp,
    Threads,
    TopK,
    TopP,
    max_tokens_limit,
    offload_knobs,
    spec_knobs,
)
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.hub import DEFAULT_MODEL


def chat(
    model: ModelArg = DEFAULT_MODEL,
    threads: Threads = None,
    ctx: Ctx = None,
    system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")] = None,
    temp: Temp = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens", "-n", help="Longest reply in tokens (default 1024); -1 = no limit."
        ),
    ] = None,
    seed: Seed = None,
    offload: Offload = None,
    gpu_layers: GpuLayers = None,
    rpc: Rpc = None,
    spec: Spec = None,
    spec_k: SpecK = None,
    precision: Precision = "fast",
    kv_dtype: KVDtype = "f16",
) -> None:
    """Chat with a model in the terminal: streaming replies, live tok/s, /help for commands."""
    from edgeinfer.config import EngineConfig
    from edgeinfer.engine.sampling import SamplingParams
    from edgeinfer.tui.app import ChatApp, ChatOptions
    from edgeinfer.tui.session import DEFAULT_MAX_TOKENS

    limit = max_tokens_limit(DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    knobs = spec_knobs(spec, spec_k) | offload_knobs(offload, gpu_layers, rpc)
    knobs["precision"] = precision
    knobs["kv_dtype"] = kv_dtype
    # bad knobs fail before the screen opens
    EngineConfig(threads=threads, ctx=ctx, parallel=1, **knobs)
    params = SamplingParams(
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        max_tokens=limit,
    )
    _check_model(model)
    app = ChatApp(ChatOptions(model, threads, ctx, system, params, knobs=knobs))
    app.run()
    if app.load_error is not None:  # e.g. a failed pull: the user saw it, the exit code says it
        raise EdgeInferError(app.load_error)


def _check_model(model: str) -> None:
    """Reject a bad name or file before the screen switches: one `error:` line and exit 2.

    A short name not pulled yet is pulled (and checked) in the app, behind the loading screen.
    """
    from edgeinfer.gguf import hub
    from edgeinfer.gguf.model_config import ModelConfig
    from edgeinfer.gguf.reader import read_gguf

    if model in hub.MODELS and not hub.model_path(model).is_file():
        return
    with read_gguf(hub.resolve_model(model, pull_missing=False)) as g:
        ModelConfig.from_gguf(g)
