"""`edgeinfer run`: complete one prompt, streaming tokens to stdout, then a stats line on stderr."""

from __future__ import annotations

import json
import math
import sys
from typing import Annotated

import typer

from edgeinfer.cli.options import (
    Ctx,
    GpuLayers,
    KVBudget,
    KVDtype,
    MinP,
    ModelArg,
    Offload,
    Parallel,
    Precision,
    Rpc,
    Seed,
    Spec,
    SpecK,
    Temp,
    Threads,
    TopK,
    TopP,
    kv_budget_bytes,
    max_tokens_limit,
    offload_knobs,
    spec_knobs,
)
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.hub import DEFAULT_MODEL


def run(
    model: ModelArg = DEFAULT_MODEL,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="The prompt.")] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-n", help="Tokens to generate; -1 = until EOS.")
    ] = 256,
    temp: Temp = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: Annotated[
        float, typer.Option("--repeat-penalty", help="Over the last 64 tokens; 1 = disabled.")
    ] = 1.0,
    seed: Seed = None,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep generating past end-of-text tokens.")
    ] = False,
    chat: Annotated[
        bool, typer.Option("--chat", help="Send the prompt as a user message (chat template).")
    ] = False,
    threads: Threads = None,
    ctx: Ctx = None,
    parallel: Parallel = 1,
    kv_budget: KVBudget = None,
    kv_dtype: KVDtype = "f16",
    offload: Offload = None,
    gpu_layers: GpuLayers = None,
    rpc: Rpc = None,
    spec: Spec = None,
    spec_k: SpecK = None,
    precision: Precision = "fast",
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (text + metrics) instead.")
    ] = False,
    logprobs: Annotated[
        bool,
        typer.Option(
            "--logprobs", help="After the text, each token's log-probability (in --json too)."
        ),
    ] = False,
    top_logprobs: Annotated[
        int | None,
        typer.Option(
            "--top-logprobs",
            help="With each token, the K likeliest alternatives (implies --logprobs).",
        ),
    ] = None,
) -> None:
    """Complete a prompt: tokens stream to stdout, then a stats line goes to stderr."""
    from edgeinfer.config import EngineConfig
    from edgeinfer.engine.sampling import SamplingParams
    from edgeinfer.llm import LLM

    if prompt is None:
        raise EdgeInferError("no prompt: pass one with -p/--prompt")
    limit = max_tokens_limit(max_tokens)
    config = EngineConfig(
        threads=threads,
        ctx=ctx,
        parallel=parallel,
        kv_budget=kv_budget_bytes(kv_budget),
        kv_dtype=kv_dtype,
        **offload_knobs(offload, gpu_layers, rpc),
        precision=precision,
        **spec_knobs(spec, spec_k),
    )
    params = SamplingParams(
        temperature=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repeat_penalty,
        seed=seed,
        stop=stop,
        max_tokens=limit,
        ignore_eos=ignore_eos,
        logprobs=top_logprobs if top_logprobs is not None else (0 if logprobs else None),
    )
    llm = LLM(model, config)
    if chat and llm.chat_template is None:
        print("note: the model has no chat template; running a plain completion", file=sys.stderr)
    if chat:
        stream = llm.stream_chat([{"role": "user", "content": prompt}], params)
    else:
        stream = llm.stream(prompt, params)
    print(llm.kv_report(), file=sys.stderr)  # once the request is accepted: errors stay one line
    if json_out:
        for _ in stream:
            pass
        result = stream.completion
        print(json.dumps({"model": model, "chat": chat, **result.as_dict()}, ensure_ascii=False))
        print_context_note(result, llm.max_context, limit)
        return
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if params.logprobs is not None:
        print_logprobs(llm.tokenizer, stream.completion.logprobs)
    sys.stdout.flush()
    print(stream.completion.metrics.summary(), file=sys.stderr)
    print_context_note(stream.completion, llm.max_context, limit)
    if config.speculative:
        s = llm.stats()
        print(
            f"speculative ({config.speculative}): {s.spec_accepted_tokens} of "
            f"{s.spec_proposed_tokens} draft tokens accepted ({s.spec_acceptance_rate:.0%}), "
            f"{s.spec_mean_accepted:.2f} per draft",
            file=sys.stderr,
        )


def print_logprobs(tokenizer, logprobs) -> None:
    """A table after the text: each token's piece, log-probability, probability and the
    likeliest alternatives (as `piece logprob`)."""

    def piece(token_id: int) -> str:
        return json.dumps(tokenizer.token_to_piece(token_id, special=True), ensure_ascii=False)

    width = max([len(piece(t.token_id)) for t in logprobs] + [5])
    print(f"\n{'token':<{width}}  {'logprob':>8}  {'p':>7}  top")
    for t in logprobs:
        top = ", ".join(f"{piece(i)} {lp:.3f}" for i, lp in t.top)
        p = 100 * math.exp(t.logprob)
        print(f"{piece(t.token_id):<{width}}  {t.logprob:8.4f}  {p:6.2f}%  {top}".rstrip())


def print_context_note(completion, max_context: int, limit: int | None) -> None:
    """Say so on stderr when generation stopped because the context was full, not because it
    reached -n: the user may want a larger --ctx."""
    m = completion.metrics
    if (
        completion.finish_reason == "length"
        and m.prompt_tokens + m.generated_tokens >= max_context
        and (limit is None or m.generated_tokens < limit)
    ):
        print(
            f"note: stopped at the context limit ({max_context} tokens: prompt "
            f"{m.prompt_tokens} + generated {m.generated_tokens}); --ctx N gives a longer one",
            file=sys.stderr,
        )
