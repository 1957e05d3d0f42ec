"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): the prompt that offers
the tools, the grammar that keeps a call well formed, and the parser that turns the reply back
into `tool_calls`.

Two formats, chosen by the chat template:
- hermes: the template renders `tools` itself and shows calls as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5 and 3, Hermes, SmolLM3).
- generic, for every other model (llama.cpp's generic format): a system message lists the tools
  with their JSON schemas and asks for `{"tool_calls": [...]}` or `{"response": "..."}`, and
  the reply is constrained to exactly that JSON, so even a model never trained on tools gives
  calls that parse and match their schemas.
tool_choice "required" or a named function constrains hermes replies too; hermes "auto" is
free text with any <tool_call> blocks parsed out of it, as vLLM's hermes parser does.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from edgeinfer.server.protocol import ChatRequest, Message, NamedToolChoice

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# Calls in one reply when parallel calls are allowed: a small model may repeat a call until
# max_tokens cuts the JSON off; the bound ends the reply with calls that still parse.
MAX_PARALLEL_CALLS = 8
# JSON as the grammar writes it: compact, so a small model cannot spend its budget on spaces
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request is prompted and constrained."""

    hermes: bool  # the template's own format; else generic
    messages: list[dict]  # as the template takes them
    template_tools: list[dict] | None  # the template's `tools` variable (hermes)
    grammar: str | None  # a lark grammar for every reply, or None (free text)
    offered: bool  # the tools are offered: replies are parsed for calls


def plan(req: ChatRequest, template_source: str | None) -> ToolPlan:
    hermes = template_source is not None and HERMES_OPEN in template_source
    messages = template_messages(req.messages, hermes)
    if not req.calls_tools:
        return ToolPlan(hermes, messages, None, None, False)
    tools = [t.function for t in req.tools]
    if isinstance(req.tool_choice, NamedToolChoice):
        tools = [f for f in tools if f.name == req.tool_choice.function.name]
    required = req.tool_choice not in (None, "auto")
    calls = _calls_schema(tools, req.parallel_tool_calls)
    if hermes:
        template_tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
        grammar = _hermes_grammar(calls) if required else None
        return ToolPlan(True, messages, template_tools, grammar, True)
    messages = _with_system(messages, _generic_instructions(tools, required))
    options = [{"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}]
    if not required:
        answer = {"type": "string"}
        options.append({"type": "object", "properties": {"response": answer}})
        options[1]["required"] = ["response"]
    for o in options:
        o["additionalProperties"] = False
    schema = options[0] if required else {"anyOf": options}
    return ToolPlan(False, messages, None, f"start: %json {json.dumps(schema | _COMPACT)}", True)


def _calls_schema(tools, parallel: bool) -> dict:
    """JSON schema of a list of calls [{"name": ..., "arguments": {...}}, ...]."""
    one = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": _arguments_schema(f)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in tools
    ]
    items = one[0] if len(one) == 1 else {"anyOf": one}
    return {
        "type": "array",
        "items": items,
        "minItems": 1,
        "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
    }


def _arguments_schema(function) -> dict:
    """A function's parameters, closed to arguments it does not declare unless it says
    otherwise (a JSON schema's default admits any extra key, which a small model fills)."""
    params = function.parameters or {"type": "object", "properties": {}}
    if params.get("type") == "object" and "additionalProperties" not in params:
        params = {**params, "additionalProperties": False}
    return params


def _hermes_grammar(calls: dict) -> str:
    block = f"{json.dumps(HERMES_OPEN + chr(10))} call {json.dumps(chr(10) + HERMES_CLOSE)}"
    more = calls["maxItems"] - 1
    repeat = f' ("\\n" {block}){{0,{more}}}' if more else ""
    return f"start: {block}{repeat}\ncall: %json {json.dumps(calls['items'] | _COMPACT)}"


def _generic_instructions(tools, required: bool) -> str:
    listed = json.dumps(
        [{"name": f.name, "description": f.description or "", "parameters": f.parameters or {}}
         for f in tools],
        ensure_ascii=False,
    )  # fmt: skip
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    how = (
        f"Reply only with a JSON object that calls one or more of them: {call}."
        if required
        else f'Reply with a JSON object: {call} to call tools, or {{"response": "<your answer>"}}.'
    )
    return f"You can use these tools:\n{listed}\n{how}"


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def template_messages(messages: list[Message], hermes: bool) -> list[dict]:
    """Messages as the chat template takes them. Hermes templates render earlier calls and
    tool results themselves (arguments as objects, Hugging Face's convention); for the others
    a call becomes the generic JSON it was made in, and tool results a user message."""
    out: list[dict] = []
    for m in messages:
        # "developer" is OpenAI's newer name for "system"; templates know the old one
        role = "system" if m.role == "developer" else m.role
        msg = {"role": role, "content": m.text()}
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c)} for c in m.tool_calls]
            if hermes:
                msg["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            else:
                msg["content"] = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        if role == "tool":
            if hermes:
                msg["tool_call_id"] = m.tool_call_id or ""
            else:
                result = {"tool_call_id": m.tool_call_id, "content": m.text()}
                text = json.dumps({"tool_response": result}, ensure_ascii=False)
                if out and out[-1].get("tool_results"):  # answers to one turn's calls: one
                    out[-1]["content"] += "\n" + text
                    continue
                msg = {"role": "user", "content": text, "tool_results": True}
        out.append(msg)
    for msg in out:
        msg.pop("tool_results", None)
    return out


def _arguments(call) -> dict | str:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


# -- replies -----------------------------------------------------------------------------------


@dataclass
class Reply:
    content: str | None
    calls: list[dict] = field(default_factory=list)  # OpenAI's tool_calls entries


def parse(text: str, hermes: bool) -> Reply:
    """A finished reply -> content and calls. A reply that does not parse (cut off by
    max_tokens, say) is all content, as vLLM returns it."""
    if hermes:
        head, sep, rest = text.partition(HERMES_OPEN)
        if not sep:
            return Reply(text)
        calls = []
        for block in (HERMES_OPEN + rest).split(HERMES_OPEN)[1:]:
            body, closed, _ = block.partition(HERMES_CLOSE)
            call = _call(body) if closed else None
            if call is None:
                return Reply(text)
            calls.append(call)
        return Reply(head.strip() or None, calls)
    try:
        obj = json.loads(text)
    except ValueError:
        return Reply(text)
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return Reply(obj["response"])
    calls = obj.get("tool_calls") if isinstance(obj, dict) else None
    parsed = [_call(json.dumps(c)) for c in calls] if isinstance(calls, list) and calls else []
    if not parsed or None in parsed:
        return Reply(text)
    return Reply(None, parsed)


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": obj["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


class StreamFilter:
    """A streamed reply's text, split into what may be shown as content now and what is held
    back for the calls: generic replies are JSON to the end; a hermes reply streams its text
    until a <tool_call> begins (holding back a tail that could be the start of one)."""

    def __init__(self, hermes: bool):
        self._hermes = hermes
        self._text: list[str] = []
        self._shown = 0  # characters released as content
        self._calling = not hermes

    def feed(self, delta: str) -> str:
        self._text.append(delta)
        if self._calling:
            return ""
        text = "".join(self._text)
        at = text.find(HERMES_OPEN, self._shown)
        if at >= 0:
            self._calling = True
            end = at
        else:
            end = len(text)
            for k in range(min(len(HERMES_OPEN) - 1, len(text) - self._shown), 0, -1):
                if text.endswith(HERMES_OPEN[:k]):
                    end -= k
                    break
        new, self._shown = text[self._shown : end], max(self._shown, end)
        return new

    def finish(self) -> Reply:
        """The whole reply parsed; `content` is only what was not streamed yet."""
        text = "".join(self._text)
        reply = parse(text, self._hermes)
        if reply.calls:
            return Reply(None, reply.calls)
        return Reply(text[self._shown :] or None) if self._hermes else reply
