"""Request bodies of the OpenAI API, validated by pydantic in strict mode.

Unknown fields are ignored, as OpenAI's API does; a known field of the wrong type or out of
range is refused (400, naming the field). Strict mode: "0.5" is not a number and `true` is not
an integer. Limits are OpenAI's where it has them, and bounds that keep one request from
occupying the server where it does not (n, stop strings).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edgeinfer.config import MAX_SPEC_K
from edgeinfer.server.errors import APIError

MAX_N = 16
MAX_STOP = 16
MAX_LOGPROBS = 20
MAX_TOOLS = 128

Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute in pydantic: read it under another name
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class _Sampling(_Body):
    """The fields chat and completions share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0  # vLLM's: lower runs first
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False  # vLLM's extension: fixed-length outputs for benchmarks
    # draft tokens a step where the server speculates (--spec): 0 = none (SamplingParams.spec_k)
    spec_k: Annotated[int, Field(ge=0, le=MAX_SPEC_K)] | None = None

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call an earlier assistant turn made (sent back in `messages`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None  # role "tool": the call this message answers

    @model_validator(mode="after")
    def _check_tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _Conversation(_Body):
    """Messages and the tools offered with them (chat, and /tokenize of messages)."""

    messages: Annotated[list[Message], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_tools(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the model is offered the tools (tool_choice defaults to auto with tools)."""
        return bool(self.tools) and self.tool_choice != "none"


class ChatRequest(_Sampling, _Conversation):
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        fmt = self.response_format
        if self.calls_tools and fmt is not None and fmt.type != "text":
            raise ValueError("response_format cannot be combined with tools")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Sampling):
    # a string, token ids, or a batch of either
    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=MAX_N)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_N)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported")
        if len(self.prompts()) * self.n > MAX_N:
            raise ValueError(f"prompts x n must be at most {MAX_N}")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TokenizeRequest(_Conversation):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """A decoded JSON body -> the validated request, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(part) for part in err["loc"]]
        # drop pydantic's union-branch names ('str', 'list[int]', 'function-after[...]')
        param = ".".join(p for p in loc if not any(c in p for c in "[]") and p not in _TYPES)
        message = err["msg"].removeprefix("Value error, ")
        where = f"{param}: " if param else ""
        raise APIError(400, f"{where}{message}", param=param or None) from None


_TYPES = {"str", "int", "float", "bool", "list", "dict", "none"}
