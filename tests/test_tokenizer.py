"""Tokenizer exactness against llama.cpp (llama-cpp-python) on the vocabulary fixtures of
llama.cpp's own test suite (tests/data/vocab), and the tokenizer's API."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizer_oracle import VOCABS, Oracle, oracle, ours, reference_cases, vocab_path

from edgeinfer.errors import GGUFError
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.tokenizer import Tokenizer
from edgeinfer.tokenizer.vocab import Vocab


@pytest.mark.parametrize("name", VOCABS)
def test_reference_cases_match_hf(name):
    # llama.cpp's test files hold HF's ids: no llama.cpp needed (make test-arm runs this)
    tok = ours(str(vocab_path(name)))
    cases = reference_cases(name)
    assert len(cases) > 40
    for text, expected in cases:
        assert tok.encode(text, add_bos=False) == expected, text


@pytest.mark.parametrize("name", VOCABS)
def test_reference_cases_match_llama_cpp(name):
    path = str(vocab_path(name))
    tok, ref = ours(path), oracle(path)
    for text, _ in reference_cases(name):
        ids = tok.encode(text, add_bos=False)
        assert ids == ref.tokenize(text, add_special=False, parse_special=False), text
        with_bos = tok.encode(text)
        assert with_bos == ref.tokenize(text, add_special=True, parse_special=False), text
        assert tok.decode(with_bos) == ref.detokenize(with_bos), text


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_attributes_match_llama_cpp(name):
    """Which tokens are control/user-defined/EOG etc. after llama.cpp's load-time fix-ups."""
    path = str(vocab_path(name))
    import llama_cpp

    tok, ref = ours(path), oracle(path)
    v = ref.vocab
    assert tok.vocab_size == ref.n_tokens
    assert tok.bos_id == llama_cpp.llama_vocab_bos(v)
    assert tok.eos_id == llama_cpp.llama_vocab_eos(v)
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(v)
    assert tok.vocab.add_eos == llama_cpp.llama_vocab_get_add_eos(v)
    attrs = [llama_cpp.llama_vocab_get_attr(v, i) for i in range(ref.n_tokens)]
    assert tok.vocab.attrs == attrs
    eog = {i for i in range(ref.n_tokens) if llama_cpp.llama_vocab_is_eog(v, i)}
    assert tok.eos_ids == eog


@pytest.mark.parametrize("name", VOCABS)
def test_every_piece_matches_llama_cpp(name):
    path = str(vocab_path(name))
    tok, ref = ours(path), oracle(path)
    for special in (False, True):
        for i in range(tok.vocab_size):
            assert tok.token_bytes(i, special) == ref.piece(i, special), (i, special)


def _special_texts(tok: Tokenizer) -> list[str]:
    """Eight special-token texts of the vocabulary: shortest and longest, repeating if few."""
    v = tok.vocab
    ids = v.special_ids[-6:] + v.special_ids[:2]
    return [v.tokens[ids[k % len(ids)]] for k in range(8)]


@pytest.mark.parametrize("name", VOCABS)
def test_special_token_parsing(name):
    path = str(vocab_path(name))
    tok, ref = ours(path), oracle(path)
    specials = _special_texts(tok)
    texts = [
        f"{specials[0]}Hello{specials[1]} world {specials[2]}\n\n{specials[3]}",
        f"  {specials[4]}  x{specials[5]}{specials[5]}y",
        f"<s>[INST] hi [/INST]</s><|im_start|>user\n<|im_end|><|endoftext|>{specials[-1]}",
        f"{specials[-2]} leading space after a special token",
    ]
    for text in texts:
        for special in (False, True):
            for add in (False, True):
                assert tok.encode(text, add_bos=None if add else False, special=special) == (
                    ref.tokenize(text, add_special=add, parse_special=special)
                ), (text, special, add)
    parsed = tok.encode(specials[0], add_bos=False, special=True)
    assert parsed == [tok.vocab.token_to_id[specials[0]]]
    assert tok.encode(specials[0], add_bos=False) != parsed or (
        tok.vocab.attrs[parsed[0]] & 16  # user-defined tokens split out even as text
    )


def test_special_false_treats_control_text_as_text():
    tok = ours(str(vocab_path("qwen2")))
    text = "<|im_start|>user"
    im_start = tok.vocab.token_to_id["<|im_start|>"]
    assert tok.encode(text, add_bos=False, special=True)[0] == im_start
    plain = tok.encode(text, add_bos=False)
    assert im_start not in plain and len(plain) > 2
    assert tok.decode(plain) == text


def test_add_bos_choices():
    tok = ours(str(vocab_path("llama-spm")))
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id
    assert tok.encode("hi", add_bos=False)[0] != tok.bos_id
    assert tok.encode("", add_bos=True) == [tok.bos_id]
    assert tok.encode("") == [tok.bos_id]
    assert tok.encode("", add_bos=False) == []
    qwen = ours(str(vocab_path("qwen2")))  # add_bos_token unset: gpt2 default is no BOS
    assert not qwen.add_bos and qwen.encode("hi") == qwen.encode("hi", add_bos=False)
    assert qwen.encode("hi", add_bos=True)[0] == qwen.bos_id


def test_decode_roundtrip_and_leading_space():
    tok = ours(str(vocab_path("llama-spm")))
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world"
    # Without the BOS the prefix space SentencePiece added stays, as in llama.cpp.
    assert tok.decode(ids[1:]) == " Hello world"
    assert tok.decode([tok.bos_id]) == ""
    assert tok.decode([tok.bos_id], special=True) == "<s>"
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])


def test_stream_decoder_never_splits_a_character():
    tok = ours(str(vocab_path("llama-spm")))
    text = "a😀b日本"
    ids = tok.encode(text)
    byte_ids = [i for i in ids if tok.vocab.tokens[i].startswith("<0x")]
    assert len(byte_ids) >= 4  # the emoji is spelled in byte-fallback tokens
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == tok.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)
    assert "😀" in pieces and pieces.count("") >= 4  # held back until the last byte
    # A stream cut inside a character yields U+FFFD only at flush, as decode does.
    dec = tok.stream_decoder()
    cut = ids[: ids.index(byte_ids[0]) + 2]
    assert "".join(dec.push(i) for i in cut) + dec.flush() == tok.decode(cut)
    assert tok.decode(cut).endswith("\ufffd")


def test_stream_decoder_bpe_matches_decode():
    tok = ours(str(vocab_path("qwen2")))
    text = "Grüße, 世界! 🦙🦙 <|im_end|> done"
    ids = tok.encode(text, special=True)
    for special in (False, True):
        dec = tok.stream_decoder(special=special)
        out = "".join(dec.push(i) for i in ids) + dec.flush()
        assert out == tok.decode(ids, special=special)
    assert tok.decode(ids) == text.replace("<|im_end|>", "")
    assert tok.decode(ids, special=True) == text


def _gpt2_copy_without_pre(tmp_path: Path, pre: str | None) -> Path:
    src = read_gguf(vocab_path("gpt-2"))
    out = tmp_path / f"gpt2-pre-{pre}.gguf"
    w = gguf.GGUFWriter(str(out), "gpt2")
    md = src.metadata
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(np.asarray(md["tokenizer.ggml.token_type"]).tolist())
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_missing_pre_falls_back_to_default_like_llama_cpp(tmp_path):
    path = str(_gpt2_copy_without_pre(tmp_path, None))
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre is missing"):
        tok = Tokenizer.from_gguf(path)
    ref = Oracle(path)
    for text in ("Hello, world!! $100 + 2000 = 12345678 ~ok~", "a'b 'll ..., ?!|^ 日本 1.5e10"):
        assert tok.encode(text) == ref.tokenize(text, add_special=True, parse_special=False)


def test_unknown_pre_warns_and_uses_default(tmp_path):
    path = str(_gpt2_copy_without_pre(tmp_path, "no-such-pre"))
    with pytest.warns(UserWarning, match="unknown"):
        tok = Tokenizer.from_gguf(path)
    assert tok.vocab.pre.name == "default"
    assert tok.decode(tok.encode("x = 1234")) == "x = 1234"


def test_unsupported_tokenizer_model_is_a_gguf_error():
    md = dict(read_gguf(vocab_path("gpt-2")).metadata)
    md["tokenizer.ggml.model"] = "bert"
    with pytest.raises(GGUFError, match="bert"):
        Vocab.from_metadata(md, Path("x.gguf"))


def test_lone_surrogates_do_not_crash():
    tok = ours(str(vocab_path("qwen2")))
    assert tok.encode("a\ud800b", add_bos=False) == tok.encode("a\ufffdb", add_bos=False)
