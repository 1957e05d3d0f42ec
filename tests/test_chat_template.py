"""Chat templates: rendering like llama.cpp / llama-cpp-python, and hostile templates contained."""

from __future__ import annotations

import ctypes
import time

import llama_cpp
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from tokenizer_oracle import ours, vocab_path

from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.tokenizer.chat_template import ChatTemplate, ChatTemplateError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there! <b>bold</b> & {{ not a tag }}"},
    {"role": "assistant", "content": "Hello. 日本語 🦙"},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def smollm(real_model):
    path = real_model("smollm2-135m-instruct")
    g = read_gguf(path)
    return g, ChatTemplate.from_gguf(g, ours(str(path)))


def _llama_cpp_builtin(template: str, messages, add_ass: bool) -> str:
    """llama.cpp's own C++ renderer (it recognises ChatML by its markers)."""
    chat = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for slot, m in zip(chat, messages, strict=True):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        slot.role, slot.content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(messages), add_ass,
                                            buf, len(buf))  # fmt: skip
    assert 0 < n <= len(buf)
    return buf.raw[:n].decode()


def test_smollm2_chatml_matches_llama_cpp(smollm):
    g, tmpl = smollm
    assert tmpl is not None
    assert (tmpl.bos_token, tmpl.eos_token) == ("<|im_start|>", "<|im_end|>")
    source = g.metadata["tokenizer.chat_template"]
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        for gen in (True, False):
            ours_text = tmpl.render(messages, add_generation_prompt=gen)
            hf_like = Jinja2ChatFormatter(source, tmpl.eos_token, tmpl.bos_token, gen)
            assert ours_text == hf_like(messages=messages).prompt
    # With a system message SmolLM2's template is plain ChatML, which llama.cpp renders itself.
    for gen in (True, False):
        assert tmpl.render(CONVERSATION, add_generation_prompt=gen) == _llama_cpp_builtin(
            source, CONVERSATION, gen
        )
    text = tmpl.render(CONVERSATION[1:2])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


def test_rendered_prompt_tokenizes_with_special_tokens(smollm, real_model):
    _, tmpl = smollm
    tok = ours(str(real_model("smollm2-135m-instruct")))
    ids = tok.encode(tmpl.render(CONVERSATION), special=True)
    im_start, im_end = (tok.vocab.token_to_id[t] for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(im_start) == 5 and ids.count(im_end) == 4
    assert im_end in tok.eos_ids


def test_base_model_has_no_template(real_model):
    assert ChatTemplate.from_gguf(read_gguf(real_model("gemma3-270m"))) is None
    assert ChatTemplate.from_gguf(vocab_path("gpt-2")) is None


def test_bos_token_from_the_vocabulary():
    tmpl = ChatTemplate.from_gguf(vocab_path("phi-3"), ours(str(vocab_path("phi-3"))))
    assert tmpl.bos_token == "<s>"
    text = tmpl.render([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"


def test_hf_extras_raise_exception_tojson_and_loop_controls():
    tmpl = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' ~ m.role) }}"
        "{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m|tojson }}{% endfor %}"
        "{% generation %}[{{ tools|length }}]{% endgeneration %}"
    )
    out = tmpl.render([{"role": "u", "content": "é"}] * 3, tools=[1, 2])
    assert out == '{"role": "u", "content": "é"}' * 2 + "[2]"
    with pytest.raises(ChatTemplateError, match="no bad"):
        tmpl.render([{"role": "bad", "content": ""}])


HOSTILE = {
    # CVE-2024-34359 style escapes from the sandbox.
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler_globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "joiner_globals": "{{ joiner.__init__.__globals__['__builtins__']['__import__']('os') }}",
    "namespace_class": "{{ namespace.__class__.__base__.__subclasses__() }}",
    "format_escape": "{{ '{0.__class__.__base__.__subclasses__}'.format('') }}",
    "attr_filter": "{{ (''|attr('__class__'))|attr('__mro__') }}{{ x.y.z.__class__ }}",
    "mutation": "{% set l = [1] %}{{ l.append(2) }}",
    # Time and memory bombs.
    "huge_range": "{% for i in range(10**9) %}x{% endfor %}",
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "nested_string_loops": "{% set s = 'a' * 100000 %}{% for i in s %}{% for j in s %}"
    "{% endfor %}{% endfor %}",
    "string_multiplication": "{{ 'a' * 10**9 }}",
    "list_multiplication": "{{ [0] * 10**9 }}",
    "power": "{{ 7 ** 10000000 }}{% set n = 2 ** 40 %}{{ n ** n }}",
    "doubling_concat": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling_plus": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "filter_width": "{% set n = 10**9 %}{{ 'x'|center(n) }}",
    "method_width": "{% set n = 10**9 %}{{ 'x'.ljust(n) }}",
    "printf_width": "{{ '%0999999999d'|format(1) }}{{ '%0999999999d' % 1 }}",
    "format_width": "{{ '{:>999999999}'.format(1) }}",
    "tojson_indent": "{% set n = 10**9 %}{{ messages|tojson(indent=n) }}",
    "macro_recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "macro_fanout": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
    "{% endmacro %}{{ f(60) }}",
    "output_flood": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "lipsum": "{{ lipsum(n=10**8) }}",
    "include": "{% include 'x' %}",
    "syntax": "{% for %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_contained(name):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate(HOSTILE[name]).render(
            [{"role": "user", "content": "hi"}], time_limit=0.5, max_output=1 << 20
        )
    assert isinstance(err.value, EdgeInferError)
    assert time.monotonic() - t0 < 5.0


def test_limits_are_per_render():
    tmpl = ChatTemplate("{% for i in range(n) %}{{ i }}{% endfor %}")
    assert tmpl.render([], n=3) == "012"
    with pytest.raises(ChatTemplateError, match="output longer"):
        tmpl.render([], n=100_000, max_output=1000)
    assert tmpl.render([], n=3) == "012"


def test_trace_function_is_restored():
    import sys

    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        ChatTemplate("{{ 1 }}").render([])
        with pytest.raises(ChatTemplateError):
            ChatTemplate("{{ raise_exception('x') }}").render([])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_bos_eos_without_a_tokenizer_match_the_tokenizer(real_model):
    path = real_model("smollm2-135m-instruct")
    alone = ChatTemplate.from_gguf(path)
    with_tok = ChatTemplate.from_gguf(path, ours(str(path)))
    assert (alone.bos_token, alone.eos_token) == (with_tok.bos_token, with_tok.eos_token)
