"""Tool calls through `edgeinfer serve`, driven by the official openai client: the generic
format (SmolLM2's own template knows no tools) and the hermes format (the same model with a
Hermes-style template from --chat-template-file), constrained calls that parse and match their
schemas, streaming, earlier calls and tool results in the prompt, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from cli_checks import edgeinfer, one_error_line
from server_proc import ServerProcess

from edgeinfer.server.tools import MAX_PARALLEL_CALLS, StreamFilter, parse

HERMES_TEMPLATE = Path(__file__).parent / "data" / "templates" / "hermes_tools.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# an earlier turn that called a tool, and the tool's answer
ANSWERED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
]


def _start(real_model, *args):
    return ServerProcess(real_model("smollm2-135m-instruct"), "--ctx", "1024", *args)


@pytest.fixture(scope="module")
def generic(real_model):
    proc = _start(real_model, "--batch-invariant")
    yield proc
    assert proc.stop() == 0
    proc.close()


@pytest.fixture(scope="module")
def hermes(real_model):
    proc = _start(real_model, "--chat-template-file", str(HERMES_TEMPLATE))
    yield proc
    assert proc.stop() == 0
    proc.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _model(server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def _ask(server, **kw):
    kw = {"messages": ASK, "tools": TOOLS, "max_tokens": 96, "temperature": 0, **kw}
    return _client(server).chat.completions.create(model=_model(server), **kw)


def _check_calls(calls, names=SCHEMAS) -> list[tuple[str, dict]]:
    """Every call names a known function and its arguments satisfy that function's schema."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert set(args) <= set(SCHEMAS[call.function.name]["properties"])
        out.append((call.function.name, args))
    return out


def _prompt_text(server, **body) -> str:
    ids = server.post("/tokenize", body).json()["tokens"]
    return server.post("/detokenize", {"tokens": ids}).json()["prompt"]


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_a_required_call_parses_and_matches_its_schema(fmt, request):
    server = request.getfixturevalue(fmt)
    r = _ask(server, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_a_named_tool_choice_calls_only_that_function(fmt, request):
    server = request.getfixturevalue(fmt)
    choice = {"type": "function", "function": {"name": "add"}}
    # room for the most parallel calls a reply may hold: the reply ends by itself
    r = _ask(server, tool_choice=choice, max_tokens=256)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = _check_calls(r.choices[0].message.tool_calls)
    assert {name for name, _ in calls} == {"add"} and len(calls) <= MAX_PARALLEL_CALLS


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_parallel_tool_calls_false_gives_one_call(fmt, request):
    server = request.getfixturevalue(fmt)
    r = _ask(server, tool_choice="required", parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


def test_generic_auto_returns_calls_or_content_never_the_raw_json(generic):
    r = _ask(generic, tool_choice="auto")
    message = r.choices[0].message
    if message.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        _check_calls(message.tool_calls)
    else:
        assert not message.content.lstrip().startswith('{"response"')


def test_a_streamed_call_equals_the_whole_response(generic):
    whole = _ask(generic, tool_choice="required")
    stream = _ask(generic, tool_choice="required", stream=True)
    calls, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            assert not c.delta.content
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [c.index for c in calls] == list(range(len(calls)))
    streamed = [(c.function.name, c.function.arguments) for c in calls]
    expected = [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert streamed == expected


def test_generic_prompt_lists_the_tools_only_when_offered(generic):
    offered = _prompt_text(generic, messages=ASK, tools=TOOLS)
    assert "get_weather" in offered and "Weather now" in offered and '"tool_calls"' in offered
    declined = _prompt_text(generic, messages=ASK, tools=TOOLS, tool_choice="none")
    assert declined == _prompt_text(generic, messages=ASK)
    assert "get_weather" not in declined


def test_generic_prompt_carries_earlier_calls_and_tool_results(generic):
    text = _prompt_text(generic, messages=ANSWERED, tools=TOOLS)
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert '"tool_response"' in text and "18 degrees, sunny" in text and "call_1" in text
    r = _client(generic).chat.completions.create(
        model=_model(generic), messages=ANSWERED, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_hermes_template_renders_tools_calls_and_results(hermes):
    text = _prompt_text(hermes, messages=ANSWERED, tools=TOOLS)
    assert "<tools>" in text and '"name": "get_weather"' in text
    # the earlier call's arguments go to the template as an object, not a JSON string
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not in tools",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "must be unique"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
                ],
                "tool_choice": "required",
            },
            "schema",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x", "tool_calls": ANSWERED[1]["tool_calls"]}
                ]
            },
            "only assistant messages carry tool_calls",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_tool_requests_get_a_400_naming_the_problem(generic, body, needle):
    r = generic.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert generic.get("/health").status_code == 200


def test_a_chat_template_file_that_does_not_compile_stops_the_start(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for x in %}")
    one_error_line(edgeinfer("serve", "--chat-template-file", str(bad)), "bad.jinja", "compile")
    missing = tmp_path / "missing.jinja"
    one_error_line(edgeinfer("serve", "--chat-template-file", str(missing)), "missing.jinja")


# -- the reply parser, on replies written by hand ------------------------------------------------


def test_hermes_reply_with_text_and_two_calls():
    reply = parse(
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        hermes=True,
    )
    assert reply.content == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply.calls] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        'Sure <tool_call>\n{"name": "a", "arguments": {"x": 1',  # cut off by max_tokens
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        "<tool_call>\nnot json\n</tool_call>",
    ],
)
def test_a_hermes_reply_that_does_not_parse_is_all_content(text):
    reply = parse(text, hermes=True)
    assert reply.content == text and reply.calls == []


def test_generic_replies():
    assert parse('{"response": "hi"}', hermes=False).content == "hi"
    calls = parse('{"tool_calls": [{"name": "a", "arguments": {"y": "z"}}]}', hermes=False).calls
    assert calls[0]["function"] == {"name": "a", "arguments": '{"y": "z"}'}
    cut = '{"tool_calls": [{"name": "a", "argu'
    assert parse(cut, hermes=False).content == cut


def test_hermes_stream_holds_back_only_what_may_open_a_call():
    f = StreamFilter(hermes=True)
    shown = [f.feed(d) for d in ["Hello <", "tool", " world <tool_", "call>\n{", '"name": "a"}']]
    # "<tool" waits until " world" shows it is not a tag; everything from <tool_call> is held
    assert shown == ["Hello ", "", "<tool world ", "", ""]
    f.feed("\n</tool_call>")
    reply = f.finish()
    assert reply.content is None and reply.calls[0]["function"]["name"] == "a"
    g = StreamFilter(hermes=True)
    assert g.feed("no calls <tool_") == "no calls "
    assert g.finish().content == "<tool_"
