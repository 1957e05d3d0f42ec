"""The FastAPI app: routes, the checks every request passes, and one log line per request.

Bodies are read and validated here rather than by FastAPI's injection, so that a body over
--max-body is a 413 before it is read whole, and a bad field is OpenAI's 400, never a 422.
Everything but /health needs an API key when keys are set (/metrics and /v1/models too).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request

from edgeinfer.errors import EdgeInferError
from edgeinfer.server import completions, logs, tools
from edgeinfer.server.errors import APIError, bad_request, error_body
from edgeinfer.server.metrics import CONTENT_TYPE
from edgeinfer.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from edgeinfer.server.settings import ServerSettings
from edgeinfer.server.state import ServerState

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


class RequestIdMiddleware:
    """Take the client's X-Request-Id (or make one), keep it in scope["state"], echo it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(settings: ServerSettings, state: ServerState | None = None) -> FastAPI:
    state = state or ServerState(settings)
    app = FastAPI(
        title="edgeinfer",
        lifespan=state.lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.server = state
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = "not found" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(
            error_body(exc.status_code, message), exc.status_code, headers=exc.headers
        )

    async def run(request: Request, handler, *, engine=True, rate=True) -> Response:
        """The checks and the log line around a handler(request, log) -> Response."""
        t0 = time.perf_counter()
        log = {
            "id": request.scope["state"]["request_id"],
            "method": request.method,
            "path": request.url.path,
            "done": lambda log: _log(state, log, t0),
        }
        try:
            log["key"] = state.authenticate(request)
            if rate:
                state.rate_limit(log["key"], request)
            if engine:
                state.ready()
            response = await handler(request, log)
        except APIError as e:
            log["status"], log["error"] = e.status, e.message
            extra = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            response = e.response(extra)
        log.setdefault("status", response.status_code)
        if not log.get("deferred"):
            _log(state, log, t0)
        return response

    async def body(request: Request, model):
        return parse(model, await _read_json(request, settings.max_body))

    @app.get("/health")
    async def health():
        if state.engine is None or state.shutting_down:
            status = "shutting down" if state.shutting_down else "loading"
            return APIError(503, f"the server is {status}", retry_after=5.0).response()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        async def handler(request, log):
            llm = state.engine.llm
            card = {
                "id": settings.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "edgeinfer",
                "max_model_len": llm.max_context,
            }
            return JSONResponse({"object": "list", "data": [card]})

        return await run(request, handler, rate=False)

    @app.get("/metrics")
    async def metrics(request: Request):
        async def handler(request, log):
            return Response(state.metrics.render(), media_type=CONTENT_TYPE)

        return await run(request, handler, engine=False, rate=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        async def handler(request, log):
            req = await body(request, ChatRequest)
            return await completions.generate(state, request, req, log)

        return await run(request, handler)

    @app.post("/v1/completions")
    async def complete(request: Request):
        async def handler(request, log):
            req = await body(request, CompletionRequest)
            return await completions.generate(state, request, req, log)

        return await run(request, handler)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        async def handler(request, log):
            req = await body(request, TokenizeRequest)
            state.check_model(req.model)
            llm = state.engine.llm
            try:  # off the event loop: a body of megabytes takes a while
                if req.prompt is not None:
                    add_bos = None if req.add_special_tokens else False
                    ids = await asyncio.to_thread(
                        llm.tokenizer.encode, req.prompt, add_bos=add_bos, special=True
                    )
                else:
                    plan = tools.plan(req, state.template_source())
                    ids = await state.chat_prompt(plan.messages, plan.template_tools)
            except EdgeInferError as e:
                raise bad_request(str(e)) from None
            return JSONResponse(
                {"count": len(ids), "max_model_len": llm.max_context, "tokens": ids}
            )

        return await run(request, handler)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        async def handler(request, log):
            req = await body(request, DetokenizeRequest)
            state.check_model(req.model)
            tokenizer = state.engine.llm.tokenizer
            bad = [t for t in req.tokens if t >= tokenizer.vocab_size]
            if bad:
                raise bad_request(
                    f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                    "tokens",
                )
            return JSONResponse({"prompt": tokenizer.decode(req.tokens)})

        return await run(request, handler)

    return app


async def _read_json(request: Request, limit: int):
    """The body as JSON; 413 past `limit` bytes (checked before and while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is over the {limit}-byte limit (--max-body)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the {limit}-byte limit (--max-body)")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise bad_request("the request body is not valid JSON") from None


def _log(state: ServerState, log: dict, t0: float) -> None:
    gen = log.pop("gen", None)
    fields = {
        "id": log["id"],
        "key": log.get("key"),
        "method": log["method"],
        "path": log["path"],
        "status": log.get("status"),
    }
    if gen is not None:
        usage = gen.usage()
        reasons = sorted({c.finish_reason for c in gen.choices if c.finish_reason})
        fields.update(
            prompt_tokens=usage["prompt_tokens"],
            output_tokens=usage["completion_tokens"],
            cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
            ttft_s=None if gen.t_first_token is None else gen.t_first_token - gen.t_arrival,
            finish_reason=log.get("finish_reason") or ",".join(reasons) or None,
        )
    fields["duration_s"] = time.perf_counter() - t0
    fields["error"] = log.get("error")
    fields["prompt"] = log.get("prompt")
    logs.request_line(state.logger, **fields)
