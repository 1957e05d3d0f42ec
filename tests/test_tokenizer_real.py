"""Exactness on the two real models: SmolLM2 (byte-level BPE, 'smollm' pre-tokenizer) and
Gemma 3 (SentencePiece, 262k tokens, user-defined whitespace tokens)."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest
from tokenizer_oracle import VOCABS, oracle, ours, reference_cases

REAL_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
CHAT_PROMPTS = {
    "smollm2-135m-instruct": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    "What is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "gemma3-270m": "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
}


def _corpus() -> str:
    """Mixed text, ~250 KB: the fixtures' test strings, this project's Python sources (code,
    indentation runs), CJK and emoji."""
    parts = [text for name in VOCABS for text, _ in reference_cases(name)]
    root = Path(__file__).parent.parent / "edgeinfer"
    parts += [p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py"))]
    parts.append(
        "我们今天学习中文。日本語のテキスト、カタカナ。한국어 문장입니다. 🦙🚀👩‍💻🇯🇵 " * 200
    )
    return "\n\n".join(parts)


@pytest.fixture(scope="module", params=REAL_MODELS)
def model(request, real_model):
    path = str(real_model(request.param))
    return request.param, ours(path), oracle(path)


def test_corpus_matches_llama_cpp(model):
    _, tok, ref = model
    text = _corpus()
    assert len(text.encode()) > 100_000
    for special in (False, True):
        ids = tok.encode(text, special=special)
        assert ids == ref.tokenize(text, add_special=True, parse_special=special)
        assert tok.decode(ids) == ref.detokenize(ids)


def test_reference_strings_match_llama_cpp(model):
    _, tok, ref = model
    for name in VOCABS:
        for text, _ in reference_cases(name):
            for special in (False, True):
                assert tok.encode(text, special=special) == ref.tokenize(text, True, special)


def test_chat_prompt_special_tokens(model):
    name, tok, ref = model
    prompt = CHAT_PROMPTS[name]
    ids = tok.encode(prompt, special=True)
    assert ids == ref.tokenize(prompt, add_special=True, parse_special=True)
    turn = "<|im_start|>" if name.startswith("smollm") else "<start_of_turn>"
    assert ids.count(tok.vocab.token_to_id[turn]) == prompt.count(turn)
    assert tok.decode(ids, special=True) == ref.detokenize(ids, special=True)


def test_vocab_attributes_and_pieces_match_llama_cpp(model):
    _, tok, ref = model
    v = ref.vocab
    assert (tok.bos_id, tok.eos_id) == (llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v))
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(v)
    assert tok.vocab.attrs == [llama_cpp.llama_vocab_get_attr(v, i) for i in range(ref.n_tokens)]
    assert tok.eos_ids == {i for i in range(ref.n_tokens) if llama_cpp.llama_vocab_is_eog(v, i)}
    for special in (False, True):
        for i in range(tok.vocab_size):
            assert tok.token_bytes(i, special) == ref.piece(i, special), (i, special)
