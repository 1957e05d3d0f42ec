"""`edgeinfer serve` on the real default model, driven by the official openai client and raw
httpx: shapes, streaming, usage and cached tokens, sampling fields, structured output,
logprobs, concurrency, errors, disconnects, metrics and a fuzz of request bodies."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_proc import ServerProcess, wait_for

CTX = 256
MAX_BODY = 64 * 1024
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(real_model):
    model = real_model("smollm2-135m-instruct")
    proc = ServerProcess(
        model,
        "--ctx", str(CTX), "--parallel", "8", "--max-body", str(MAX_BODY),
        "--batch-invariant", "--log-format", "json",
    )  # fmt: skip
    proc.model_path = model
    yield proc
    assert proc.stop() == 0
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(server):
    return server.get("/v1/models").json()["data"][0]["id"]


def sse_events(resp: httpx.Response) -> list:
    """The `data:` payloads of a stream, JSON-decoded ([DONE] kept as the string)."""
    out = []
    for block in resp.text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- endpoints and shapes -----------------------------------------------------------------------


def test_health_and_models(server, model_id):
    assert server.get("/health").json() == {"status": "ok"}
    models = server.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == model_id == server.model_path.name
    assert card["object"] == "model" and card["max_model_len"] == CTX


def test_chat_completion(client, server, model_id):
    r = client.chat.completions.create(model=model_id, messages=HI, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model_id
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    prompt = server.post("/tokenize", {"messages": HI}).json()["count"]
    assert r.usage.prompt_tokens == prompt
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == prompt + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_frames(server, client, model_id):
    body = {"messages": HI, "max_tokens": 6, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    resp = server.post("/v1/chat/completions", body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["usage"]["completion_tokens"] >= 1
    assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in events[:-1]}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = client.chat.completions.create(model=model_id, messages=HI, max_tokens=6, temperature=0)
    assert text == whole.choices[0].message.content
    assert usage["usage"]["completion_tokens"] == whole.usage.completion_tokens


def test_stream_without_usage_has_no_usage_field(server):
    body = {"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "stream": True}
    events = sse_events(server.post("/v1/completions", body))
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_stream_matches_whole(client, model_id):
    kw = dict(model=model_id, prompt="Once upon a time", max_tokens=6, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    parts = [c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].text


def test_completion_token_id_prompt_and_echo(client, server, model_id):
    ids = server.post("/tokenize", {"prompt": "The capital of France is"}).json()["tokens"]
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(
        model=model_id, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(
        model=model_id, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The capital of France is" + by_text.choices[0].text


def test_cached_tokens_reported(client, model_id):
    messages = [{"role": "system", "content": "You are a terse assistant. " * 8}, *HI]
    first = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=2, temperature=0
    )
    again = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=2, temperature=0
    )
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 64
    assert cached >= 64 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_tokenize_detokenize(server):
    tok = server.post("/tokenize", {"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == CTX
    assert server.post("/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    chat = server.post("/tokenize", {"messages": HI}).json()
    assert chat["count"] > tok["count"]
    assert server.post("/detokenize", {"tokens": [10**7]}).status_code == 400


def test_request_id_echoed(server):
    r = server.post("/tokenize", {"prompt": "x"}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    generated = server.post("/tokenize", {"prompt": "x"}).headers["x-request-id"]
    assert len(generated) == 32
    assert '"id": "abc-123"' in server.output()


# -- sampling fields ---------------------------------------------------------------------------


def test_stop_string(client, model_id):
    kw = dict(model=model_id, prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert " 7" in free, free
    stopped = client.completions.create(**kw, stop=[" 7", "never"]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(" 7")]


def test_seed_reproducible(client, model_id):
    kw = dict(model=model_id, messages=HI, max_tokens=5, temperature=1.5, top_p=1)
    kw["extra_body"] = {"top_k": 0}  # a field outside OpenAI's API, as vLLM takes it
    a = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    others = {
        client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (1, 2)
    }
    assert a == b
    assert len(others | {a}) > 1  # the seed matters


def test_n_choices_share_the_prompt(client, server, model_id):
    messages = [{"role": "system", "content": "Answer in one word. " * 10}, *HI]
    hits = server.metric("edgeinfer:prefix_cache_hits_total")
    r = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=4, temperature=1.0, seed=7, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    # the two later choices reuse the prompt's full blocks
    full_blocks = (r.usage.prompt_tokens - 1) // 16 * 16
    assert server.metric("edgeinfer:prefix_cache_hits_total") - hits >= 2 * full_blocks
    stream = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=4, temperature=1.0, seed=7, n=3,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    texts, finishes, usage = ["", "", ""], {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == [c.message.content for c in r.choices]  # same seed, same choices
    assert sorted(finishes) == [0, 1, 2]
    assert usage.completion_tokens == r.usage.completion_tokens


def test_logit_bias(client, server, model_id):
    kw = dict(model=model_id, prompt="The capital of France is", max_tokens=1, temperature=0)
    best = client.completions.create(**kw).choices[0].text
    (best_id,) = server.post("/tokenize", {"prompt": best, "add_special_tokens": False}).json()[
        "tokens"
    ]
    banned = client.completions.create(**kw, logit_bias={str(best_id): -100}).choices[0].text
    assert banned != best
    forced = client.completions.create(**kw, logit_bias={"13": 100}).choices[0].text
    assert forced == server.post("/detokenize", {"tokens": [13]}).json()["prompt"]


def test_logprobs_match_llm_logits(client, server, model_id):
    from edgeinfer import LLM, SamplingParams

    ids = server.post("/tokenize", {"prompt": "The quick brown fox"}).json()["tokens"]
    r = client.completions.create(
        model=model_id, prompt=ids, max_tokens=3, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    chat = client.chat.completions.create(
        model=model_id, messages=HI, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(
        len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-9 for t in content
    )
    assert "".join(bytes(t.bytes).decode() for t in content) == chat.choices[0].message.content

    text = r.choices[0].text
    out = server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    pieces = [server.post("/detokenize", {"tokens": [t]}).json()["prompt"] for t in out]
    assert pieces == lp.tokens  # the generated ids, recovered from the text
    llm = LLM(str(server.model_path), threads=2, ctx=CTX, parallel=1, batch_invariant=True)
    # the engine's own logprobs for the same request: the server passes them on unchanged
    (alone,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, logprobs=3))
    assert alone.token_ids == out
    for mine, theirs, top in zip(alone.logprobs, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert math.isclose(mine.logprob, theirs, abs_tol=0.02)
        assert [i for i, _ in mine.top] == top_ids(llm, top)
    # and they are the log-softmax of the model's logits at each position (the engine's step
    # and LLM.logits' forward pass round differently: ~0.05 apart at most on this model)
    logits = llm.logits(ids + out[:-1])[len(ids) - 1 :].astype(np.float64)
    logsoft = logits - logits.max(1, keepdims=True)
    logsoft -= np.log(np.exp(logsoft).sum(1, keepdims=True))
    for i, token in enumerate(out):
        assert int(np.argmax(logsoft[i])) == token  # greedy
        assert math.isclose(lp.token_logprobs[i], logsoft[i, token], abs_tol=0.1)
        (top_piece, top_lp), *_ = lp.top_logprobs[i].items()
        assert top_piece == lp.tokens[i] and math.isclose(top_lp, lp.token_logprobs[i])


def top_ids(llm, pieces: dict) -> list[int]:
    by_piece = {
        llm.tokenizer.token_to_piece(i, special=True): i for i in range(llm.tokenizer.vocab_size)
    }
    return [by_piece[p] for p in pieces]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def test_json_schema_response(client, model_id):
    messages = [{"role": "user", "content": "Describe a person called Ann as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=60, temperature=0.7, seed=3,
        response_format=fmt,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    obj = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert obj.choices[0].message.content.startswith("{")


def test_bad_json_schema_is_400(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    r = server.post("/v1/chat/completions", {"messages": HI, "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


# -- concurrency -------------------------------------------------------------------------------


def test_16_concurrent_streams_equal_alone(server, model_id):
    prompts = [f"Write a short sentence about the number {i}." for i in range(16)]

    async def one(http, prompt):
        body = {
            "model": model_id,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
        }
        text = ""
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        text += c["delta"].get("content") or ""
        return text

    async def run(concurrent):
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
            if concurrent:
                return await asyncio.gather(*(one(http, p) for p in prompts))
            return [await one(http, p) for p in prompts]

    alone = asyncio.run(run(False))
    together = asyncio.run(run(True))
    assert together == alone
    assert len(set(alone)) > 1


# -- errors ------------------------------------------------------------------------------------


def _error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": HI, "temperature": "hot"}, "temperature"),
        ({"messages": HI, "temperature": 3}, "temperature"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": HI, "n": 0}, "n"),
        ({"messages": HI, "top_p": 0}, "top_p"),
        ({"messages": HI, "logprobs": 1}, "logprobs"),
        ({"messages": HI, "top_logprobs": 3}, None),
        ({"messages": HI, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": HI, "stop": ""}, None),
        ({"messages": HI, "stream": "yes"}, "stream"),
        ({"messages": HI, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": HI, "logit_bias": {"5": 101}}, None),
        ({"messages": HI, "response_format": {"type": "xml"}}, None),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
        ({"messages": [{"role": "user", "content": 5}]}, None),
        ({}, "messages"),
    ],
)
def test_invalid_chat_fields_are_400(server, body, param):
    _error(server.post("/v1/chat/completions", body), 400, param)


def test_unknown_fields_are_ignored(server):
    r = server.post(
        "/v1/chat/completions",
        {"messages": HI, "max_tokens": 1, "user": "u1", "frobnicate": {"a": 1}},
    )
    assert r.status_code == 200


def test_malformed_bodies(server):
    url = server.url + "/v1/chat/completions"
    _error(httpx.post(url, content=b"{not json", timeout=30), 400)
    _error(httpx.post(url, content=b"[1, 2]", timeout=30), 400)
    _error(httpx.post(url, content=b"", timeout=30), 400)
    _error(httpx.post(url, content="\ud800".encode("utf-8", "surrogatepass"), timeout=30), 400)


def test_prompt_over_the_context_is_400_with_both_numbers(server):
    err = _error(server.post("/v1/completions", {"prompt": [1] * (CTX + 10)}), 400, "prompt")
    assert str(CTX + 10) in err["message"] and str(CTX) in err["message"]
    long_chat = [{"role": "user", "content": "word " * 400}]
    err = _error(server.post("/v1/chat/completions", {"messages": long_chat}), 400, "messages")
    assert str(CTX) in err["message"]
    _error(server.post("/v1/completions", {"prompt": [10**7]}), 400, "prompt")


def test_unknown_model_is_404(server, client):
    _error(server.post("/v1/chat/completions", {"model": "gpt-9", "messages": HI}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=HI)


def test_body_over_the_limit_is_413(server):
    big = {"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    _error(server.post("/v1/chat/completions", big), 413)

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    resp = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
    _error(resp, 413)


def test_unknown_route_and_method(server):
    _error(server.get("/v2/nothing"), 404)
    resp = server.get("/v1/chat/completions")
    assert resp.status_code == 405 and "error" in resp.json()


# -- disconnects and metrics -------------------------------------------------------------------


def test_disconnect_aborts_and_frees_blocks(server):
    def aborted() -> float:
        return _metric_or_zero(server, "edgeinfer:request_success_total", finished_reason="abort")

    def running() -> float:
        return server.metric("edgeinfer:num_requests_running")

    before = aborted()
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: {")
            if seen == 2:
                break
        assert running() == 1
    wait_for(lambda: aborted() - before == 1 and running() == 0, timeout=30)
    # non-streaming too: the client gives up while the request runs (a fixed timeout raced
    # the 200 tokens on a fast machine, which then finished them before it saw the close)
    asyncio.run(_give_up_while_running(server, running, {**body, "stream": False}))
    wait_for(lambda: aborted() - before == 2 and running() == 0, timeout=30)
    assert server.metric("edgeinfer:kv_cache_usage_perc") == 0.0
    assert server.metric("edgeinfer:kv_window_cache_usage_perc") == 0.0  # no window layers
    assert '"finish_reason": "disconnect"' in server.output()


async def _give_up_while_running(server, running, body) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        reply = asyncio.ensure_future(http.post(server.url + "/v1/completions", json=body))
        while running() != 1:
            assert not reply.done(), "the request ended before the client gave up"
            await asyncio.sleep(0.02)
        reply.cancel()  # the client's connection closes with the cancelled read
        with pytest.raises(asyncio.CancelledError):
            await reply


def _metric_or_zero(server, name, **labels) -> float:
    try:
        return server.metric(name, **labels)
    except KeyError:
        return 0.0


def test_metrics_move(server, client, model_id):
    before = {
        n: _metric_or_zero(server, n)
        for n in (
            "edgeinfer:prompt_tokens_total",
            "edgeinfer:generation_tokens_total",
            "edgeinfer:time_to_first_token_seconds_count",
            "edgeinfer:e2e_request_latency_seconds_count",
            "edgeinfer:request_queue_time_seconds_count",
            "edgeinfer:prefix_cache_queries_total",
        )
    }
    stop = _metric_or_zero(server, "edgeinfer:request_success_total", finished_reason="length")
    r = client.completions.create(model=model_id, prompt="Hello there", max_tokens=3, temperature=0)
    after = {n: server.metric(n) for n in before}
    assert after["edgeinfer:prompt_tokens_total"] - before["edgeinfer:prompt_tokens_total"] == (
        r.usage.prompt_tokens
    )
    assert (
        after["edgeinfer:generation_tokens_total"] - before["edgeinfer:generation_tokens_total"]
        == 3
    )
    for n in before:
        if not n.endswith("tokens_total"):
            assert after[n] > before[n], n
    assert server.metric("edgeinfer:request_success_total", finished_reason="length") == stop + 1
    text = server.get("/metrics").text
    for name in ("num_requests_waiting", "num_preemptions_total", "inter_token_latency_seconds"):
        assert f"edgeinfer:{name}" in text
    assert 'model_name="' + model_id + '"' in text


def test_request_log_lines(server):
    server.post("/v1/completions", {"prompt": "secret prompt text", "max_tokens": 1})
    lines = [json.loads(line) for line in server.output().splitlines() if line.startswith("{")]
    requests = [entry for entry in lines if entry.get("event") == "request"]
    last = [e for e in requests if e["path"] == "/v1/completions" and e["status"] == 200][-1]
    for field in ("id", "status", "prompt_tokens", "output_tokens", "cached_tokens", "ttft_s"):
        assert field in last
    assert last["finish_reason"] == "length" and last["duration_s"] > 0
    assert "secret prompt text" not in server.output()  # no --log-prompts


# -- fuzz ----------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    ["messages", "prompt", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
     "logit_bias", "logprobs", "top_logprobs", "stream", "stream_options", "response_format",
     "priority", "presence_penalty", "repetition_penalty", "echo", "model", "junk"]
)  # fmt: skip
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "bot"]),
        "content": _json | st.text(max_size=30),
    }
)
_prompt = st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=8)


@st.composite
def _bodies(draw):
    body = draw(st.dictionaries(_fields, _json, max_size=6))
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(_message, max_size=3))
    if draw(st.booleans()):
        body["prompt"] = draw(_prompt)
    # generation stays short whatever else is drawn
    body["max_tokens"] = draw(st.sampled_from([1, 2, 0, -1, "2", 1.5, True, None]))
    body.pop("max_completion_tokens", None)
    if body["max_tokens"] is None:
        body["max_tokens"] = 1
    return body


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzz_bodies(server, body, path):
    raw = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity as Python writes them
    resp = httpx.post(server.url + path, content=raw, timeout=120)
    assert resp.status_code == 200 or 400 <= resp.status_code < 500, (body, resp.text)
    if resp.status_code != 200:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert server.get("/health").status_code == 200


def test_huge_prompt_is_refused_before_tokenizing(server):
    text = "abcdefgh" * 7000  # ~56 KB: more bytes than CTX tokens of any length can hold
    t0 = time.monotonic()
    err = _error(server.post("/v1/completions", {"prompt": text}), 400, "prompt")
    assert "at least" in err["message"] and str(CTX) in err["message"]
    err = _error(
        server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        400,
        "messages",
    )
    assert err["code"] == "context_length_exceeded" and time.monotonic() - t0 < 10
