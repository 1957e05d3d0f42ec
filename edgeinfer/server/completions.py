"""POST /v1/chat/completions and /v1/completions: a validated request -> a Generation -> one
JSON body, or an SSE stream of chunks (role first, one chunk per engine output, a finish chunk
per choice, the usage chunk when asked for, then [DONE])."""

from __future__ import annotations

import json
import time

from fastapi.responses import JSONResponse
from starlette.requests import Request

from edgeinfer.server import sse, tools
from edgeinfer.server.errors import APIError
from edgeinfer.server.generate import Generation
from edgeinfer.server.protocol import ChatRequest
from edgeinfer.server.responses import Shapes
from edgeinfer.server.sampling import choice_params
from edgeinfer.server.state import ServerState


def _shutdown() -> APIError:
    return APIError(503, "the server is shutting down", code="shutting_down")


async def generate(state: ServerState, request: Request, req, log: dict):
    """Run `req` (a ChatRequest or CompletionRequest); fills `log` as it goes -> a Response.
    For a stream, the log line is written when the stream ends: log["deferred"] is set."""
    engine = state.ready()
    state.check_model(req.model)
    chat = isinstance(req, ChatRequest)
    llm = engine.llm
    tokenizer = llm.tokenizer
    plan = None
    if chat:
        plan = tools.plan(req, state.template_source())
        state.check_prompt_size(["".join(m["content"] for m in plan.messages)], "messages")
        if state.settings.log_prompts:
            log["prompt"] = json.dumps(plan.messages)
        prompts = [await state.chat_prompt(plan.messages, plan.template_tools)]
    else:
        prompts = req.prompts()
        state.check_prompt_size([p for p in prompts if isinstance(p, str)], "prompt")
        if state.settings.log_prompts:
            log["prompt"] = json.dumps(prompts[0] if len(prompts) == 1 else prompts)
    grammar = None
    fmt = req.response_format
    if req.ignore_eos and (plan is not None and plan.grammar or fmt and fmt.type != "text"):
        raise APIError(400, "ignore_eos cannot be combined with a constrained reply", "ignore_eos")
    if plan is not None and plan.grammar is not None:
        grammar = await state.grammar(lark=plan.grammar)
    elif fmt is not None and fmt.type != "text":
        schema = {"type": "object"} if fmt.type == "json_object" else fmt.json_schema.schema_
        grammar = await state.grammar(schema if schema is not None else {})
    state.admit()
    vocab = tokenizer.vocab_size
    gen = Generation(
        engine,
        state.metrics,
        prompts,
        req.n,
        lambda i: choice_params(req, i, vocab, grammar),
        req.priority,
        "messages" if chat else "prompt",
    )
    gen.start()
    state.generations.add(gen)
    log["gen"] = gen
    shapes = Shapes(gen.id, state.settings.model_name, int(time.time()), chat, tokenizer)
    echo = [_text(tokenizer, p) for p in prompts] if getattr(req, "echo", False) else None
    if req.stream:
        log["deferred"] = True

        def finish():  # once, however the stream ended (even if it never started)
            state.generations.discard(gen)
            gen.close()
            if any(c.finish_reason is None for c in gen.choices) and "error" not in log:
                log["finish_reason"] = "disconnect"
            log["done"](log)

        return sse.EventStream(_stream(gen, shapes, req, echo, plan, log), on_close=finish)
    try:
        await sse.until_disconnect(_drain(gen), request.receive)
    finally:
        state.generations.discard(gen)
    if gen.aborted:
        raise _shutdown()
    if any(c.finish_reason is None for c in gen.choices):  # the client went away
        log["finish_reason"] = "disconnect"
        log["status"] = 499
        return JSONResponse({}, status_code=499)
    want_logprobs = req.num_logprobs is not None
    choices = []
    for c in gen.choices:
        text = (echo[c.prompt_index] if echo else "") + "".join(c.text)
        reply = tools.parse(text, plan.hermes) if plan and plan.offered else tools.Reply(text)
        lp = c.logprobs if want_logprobs else None
        finish = "tool_calls" if reply.calls else c.finish_reason
        choices.append(shapes.choice(c.index, reply.content, lp, finish, reply.calls))
    return JSONResponse(shapes.response(choices, gen.usage()))


def _text(tokenizer, prompt) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


async def _drain(gen: Generation) -> None:
    async for _ in gen.events():
        pass


async def _stream(gen: Generation, shapes: Shapes, req, echo, plan, log):
    usage = req.include_usage
    want_logprobs = req.num_logprobs is not None
    opened: set[int] = set()
    offsets = [0] * len(gen.choices)  # completions: text offsets for logprobs
    # tools offered: each choice's text passes a filter that holds back its calls
    filters = (
        [tools.StreamFilter(plan.hermes) for _ in gen.choices] if plan and plan.offered else None
    )
    try:
        if echo:
            for c in gen.choices:
                offsets[c.index] = len(echo[c.prompt_index])
                yield sse.frame(shapes.chunk(c.index, echo[c.prompt_index], usage=usage))
        async for event in gen.events(sse.KEEP_ALIVE_S):
            if event is None:
                yield sse.KEEP_ALIVE
                continue
            index, text, token_ids, logprobs = event
            choice = gen.choices[index]
            if shapes.chat and index not in opened:
                opened.add(index)
                yield sse.frame(shapes.chunk(index, "", role=True, usage=usage))
            if filters is not None:
                text = filters[index].feed(text)
            if text or (want_logprobs and logprobs):
                lp = logprobs if want_logprobs else None
                yield sse.frame(
                    shapes.chunk(index, text, lp, text_offset=offsets[index], usage=usage)
                )
                offsets[index] += len(text)
            if choice.finish_reason is not None:
                if gen.aborted:
                    raise _shutdown()
                finish = choice.finish_reason
                if filters is not None:
                    reply = filters[index].finish()
                    if reply.content or reply.calls:
                        yield sse.frame(
                            shapes.chunk(index, reply.content, tool_calls=reply.calls, usage=usage)
                        )
                    finish = "tool_calls" if reply.calls else finish
                yield sse.frame(shapes.chunk(index, None, finish=finish, usage=usage))
        if usage:
            yield sse.frame(shapes.usage_chunk(gen.usage()))
        yield sse.DONE
    except APIError as e:  # after the 200 went out: the error travels as an event
        log["status"] = e.status
        log["error"] = e.message
        yield sse.frame(e.body())
        yield sse.DONE
