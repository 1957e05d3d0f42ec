"""Chat templates (`tokenizer.chat_template`): untrusted Jinja code from the model file.

Rendered in jinja2's ImmutableSandboxedEnvironment (no attribute escapes such as
`__class__.__mro__`, no mutation of lists or dicts), set up like Hugging Face's and
llama-cpp-python's renderers (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, `tojson`) so templates render the same. The sandbox alone does not bound time
or memory, so rendering also has:

- a deadline, checked by a trace function on every line Python runs during the render (the
  template's own compiled code and the filters it calls): a thread cannot be killed, so the
  render itself must stop; a loop with an empty body still runs a line per iteration;
- size checks where one operation could build something huge at once: `*`, `**`, `+`, `%`
  and `~` results, filter and method arguments (`center(10**9)`), format widths;
- a cap on the rendered output.

Anything that fails or breaks a limit raises ChatTemplateError.
"""

from __future__ import annotations

import json
import re
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.reader import GGUFFile, read_gguf
from edgeinfer.tokenizer.vocab import bos_eos_ids

TIME_LIMIT_S = 2.0
# Bounds the output and any one string, list, or int argument built while rendering.
MAX_OUTPUT_CHARS = 1 << 23
MAX_TEMPLATE_CHARS = 1 << 20
_MAX_RANGE = 100_000  # as jinja's own sandbox
_MAX_INT_BITS = 1 << 16
_TRACE_CHECK_EVERY = 256  # trace events between clock reads


class ChatTemplateError(EdgeInferError):
    """A chat template that is invalid, fails, or breaks the sandbox's limits."""


class _Abort(BaseException):
    # Raised from inside the render; a BaseException so no `except Exception` in Jinja or a
    # filter can swallow it.
    pass


class _GenerationTag(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}` marker: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            _check_repeat(left, right)
            _check_repeat(right, left)
            if _is_int(left) and _is_int(right):
                _check_bits(abs(left).bit_length() + abs(right).bit_length())
        elif operator == "**" and _is_int(left) and _is_int(right):
            _check_bits(abs(left).bit_length() * max(right, 0))
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        return _checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_args(args, kwargs)
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        # str.format / format_map, which the sandbox already wraps: check widths first.
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def checked(*args, **kwargs):
            _check_format(value.__self__)
            return wrapped(*args, **kwargs)

        return checked


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"chat template too long ({len(source)} characters)")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _LimitedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        # lipsum builds text in a Python loop sized by its argument; templates never need it.
        env.globals.pop("lipsum", None)
        env.globals.update(range=_range, raise_exception=_raise_exception, strftime_now=_now)
        env.filters["tojson"] = _tojson
        for name, fn in list(env.filters.items()):
            env.filters[name] = _guarded(fn)
        # Compiling evaluates constant expressions (filters on literals), so it runs under the
        # same limits as rendering.
        with _limits(TIME_LIMIT_S, "does not compile"):
            self._template = env.from_string(source)
        # `~` compiles to calls of these helpers, looked up in the template's module globals.
        namespace = self._template.root_render_func.__globals__
        for name in ("str_join", "markup_join"):
            if name in namespace:
                namespace[name] = _guarded(namespace[name])

    @classmethod
    def from_gguf(cls, g, tokenizer=None) -> ChatTemplate | None:
        """The model's template, or None for a model without one (a base model: use plain
        completion). `g`: a GGUFFile or a path. bos_token/eos_token are the texts of the
        model's BOS/EOS tokens, from `tokenizer` or else from the metadata."""
        if not isinstance(g, GGUFFile):
            g = read_gguf(g)
        source = g.metadata.get("tokenizer.chat_template")
        if not isinstance(source, str) or not source.strip():
            return None
        if tokenizer is not None:
            return cls.for_tokenizer(source, tokenizer)
        texts = g.metadata.get("tokenizer.ggml.tokens") or []
        return cls._with_specials(source, texts, *bos_eos_ids(g.metadata))

    @classmethod
    def for_tokenizer(cls, source: str, tokenizer) -> ChatTemplate:
        """`source` (a template given by the user, say) with the tokenizer's BOS/EOS texts."""
        return cls._with_specials(
            source, tokenizer.vocab.tokens, tokenizer.bos_id, tokenizer.eos_id
        )

    @classmethod
    def _with_specials(cls, source: str, texts, bos: int | None, eos: int | None) -> ChatTemplate:
        return cls(
            source,
            bos_token=texts[bos] if bos is not None else "",
            eos_token=texts[eos] if eos is not None else "",
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        time_limit: float = TIME_LIMIT_S,
        max_output: int = MAX_OUTPUT_CHARS,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` ({"role": ..., "content": ...} dicts). Extra keyword
        arguments (tools, documents, ...) are passed to the template as variables."""
        context = {
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        parts: list[str] = []
        size = 0
        with _limits(time_limit):
            for chunk in self._template.generate(**context):
                size += len(chunk)
                if size > max_output:
                    raise _Abort(f"output longer than {max_output} characters")
                parts.append(chunk)
        return "".join(parts)


@contextmanager
def _limits(time_limit: float, failed: str = "failed"):
    """Run untrusted template code with a deadline; any failure -> ChatTemplateError."""
    deadline = time.monotonic() + time_limit
    events = 0

    def trace(frame, event, arg):
        nonlocal events
        events += 1
        if events % _TRACE_CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise _Abort(f"took longer than {time_limit:g} s")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    except _Abort as e:
        raise ChatTemplateError(f"chat template stopped: {e}") from None
    except ChatTemplateError:
        raise
    except Exception as e:  # any failure inside untrusted template code
        raise ChatTemplateError(f"chat template {failed}: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _now(fmt: str) -> str:
    _check_format(fmt)
    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face's tojson: no HTML escaping, unicode kept.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _range(*args: int):
    if len(args) > 3 or not all(_is_int(a) for a in args):
        raise TypeError("range() takes 1 to 3 integers")
    r = range(*args)
    if len(r) > _MAX_RANGE:
        raise _Abort(f"range of {len(r)} items")
    return r


def _guarded(fn):
    # Filters marked pass_context/pass_environment/pass_eval_ctx get that first, then the value.
    value_at = 1 if hasattr(fn, "jinja_pass_arg") else 0
    is_format = getattr(fn, "__name__", "") == "do_format"

    def guarded(*args, **kwargs):
        _check_args(args[value_at + 1 :], kwargs)
        if is_format and len(args) > value_at and isinstance(args[value_at], str):
            _check_format(args[value_at])
        return _checked(fn(*args, **kwargs))

    for attr in ("jinja_pass_arg", "__name__"):
        if hasattr(fn, attr):
            setattr(guarded, attr, getattr(fn, attr))
    return guarded


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS:
        raise _Abort("number too large")


def _check_repeat(seq, n) -> None:
    if isinstance(seq, (str, list, tuple)) and _is_int(n) and len(seq) * n > MAX_OUTPUT_CHARS:
        raise _Abort(f"repeating {len(seq)} items {n} times")


def _check_args(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if _is_int(a) and abs(a) > MAX_OUTPUT_CHARS:
            raise _Abort(f"argument {a} too large")


_NUMBER = re.compile(r"\d+")


def _check_format(fmt: str) -> None:
    # A width or precision in a format string ("%0999999999d", "{:>999999999}") allocates it.
    for digits in _NUMBER.findall(fmt):
        if len(digits) > 7 or int(digits) > MAX_OUTPUT_CHARS:
            raise _Abort(f"format width {digits[:12]} too large")


def _checked(value):
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_OUTPUT_CHARS:
        raise _Abort(f"value of {len(value)} items")
    if _is_int(value):
        _check_bits(value.bit_length())
    return value
