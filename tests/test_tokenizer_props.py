"""Property-based exactness: random text tokenized and detokenized by edgeinfer and llama.cpp
must agree, on the fixture vocabularies and both real models."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_oracle import VOCABS, oracle, ours, vocab_path

REAL_MODELS = ("smollm2-135m-instruct", "gemma3-270m")

# Texts that sit on tokenizer edge cases: special-token look-alikes, SentencePiece's space
# marker, byte-token spellings, contractions (case-insensitive in Llama 3), Unicode
# whitespace that is not ASCII, characters assigned after Unicode 15.1 (llama.cpp's table),
# ligatures, combining marks, digits of other scripts.
TRICKY = (
    "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>",
    "<end_of_turn>", "<|begin_of_text|>", "<0x41>", "<0xE6>", "\u2581", "\u2581\u2581", "'s",
    "'LL", "'Ve", " 's", "'d", "\r\n", "\u00a0", "\u3000", "\u2028", "\u0085", "\x1c", "\x00",
    "\u1c89", "\U00010d40", "\U0001fae8", "\ufb01", "e\u0301", "\u0915\u094d\u0937",
    "\u0663\u0664", "\u00bd", "\u2026", "    ", "\t\t", "\n\n\n", "1234567", "3.14", "a.b",
    "\U0001f9d1\u200d\U0001f4bb", "\U0001f1ef\U0001f1f5", "\u2764\ufe0f", "\U0001f999",
)  # fmt: skip


@st.composite
def texts(draw, specials: list[str]) -> str:
    part = st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=6),
        st.text(st.sampled_from(" \t\n\r\u00a0\u3000\u2009"), min_size=1, max_size=7),
        st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), max_size=5),
        st.text(st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), max_size=3),
        st.text(st.characters(min_codepoint=0x0300, max_codepoint=0x036F), max_size=3),
        st.from_regex(r"[0-9]{1,9}", fullmatch=True),
        st.text(st.sampled_from("aZé'. ,!?-_"), max_size=8),
        st.sampled_from(TRICKY),
        st.sampled_from(specials),
    )
    return "".join(draw(st.lists(part, max_size=10)))


def _check(path: str, data) -> None:
    tok, ref = ours(path), oracle(path)
    v = tok.vocab
    specials = [v.tokens[i] for i in v.special_ids[:20] + v.special_ids[-20:]]
    text = data.draw(texts(specials), label="text")
    special = data.draw(st.booleans(), label="special")
    add = data.draw(st.booleans(), label="add_special")
    ids = tok.encode(text, add_bos=None if add else False, special=special)
    assert ids == ref.tokenize(text, add_special=add, parse_special=special)
    for render_special in (False, True):
        decoded = tok.decode(ids, special=render_special)
        assert decoded == ref.detokenize(ids, special=render_special)
        dec = tok.stream_decoder(special=render_special)
        assert "".join(dec.push(i) for i in ids) + dec.flush() == decoded


_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", VOCABS)
@_SETTINGS
@given(data=st.data())
def test_random_text_matches_llama_cpp(name, data):
    _check(str(vocab_path(name)), data)


@pytest.mark.parametrize("model", REAL_MODELS)
@_SETTINGS
@given(data=st.data())
def test_random_text_matches_llama_cpp_real_models(real_model, model, data):
    _check(str(real_model(model)), data)
