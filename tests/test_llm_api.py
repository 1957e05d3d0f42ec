"""The Python API: stop strings over streamed text, Sequence bookkeeping with a real tokenizer,
LLM on a tiny synthetic model, and the real models against llama.cpp's greedy continuation."""

from __future__ import annotations

import numpy as np
import pytest

from edgeinfer import LLM, SamplingParams
from edgeinfer.engine.sequence import Sequence
from edgeinfer.engine.stop import StopStrings
from edgeinfer.errors import EdgeInferError
from edgeinfer.llm import PromptError

# A gap between llama.cpp's best logit and the logit of the token we chose below this is a
# near-tie: different (correct) arithmetic may order the two either way.
NEAR_TIE = 0.3
SMOL = "smollm2-135m-instruct"


def test_stop_strings_find_the_earliest_match_in_new_text():
    s = StopStrings(("END", "\n\n", "xyz"))
    assert s.find("abc\n\nEND", 0) == 3
    assert s.find("abcEN", 0) == -1
    assert s.find("abcEND", 5) == 3  # reaches back into text already searched
    assert s.find("xyzEND", 4) == 3  # a match wholly before the new part was already handled


def test_safe_len_holds_back_what_could_still_become_a_stop_string():
    s = StopStrings(("STOP", "<|end|>"))
    assert s.safe_len("hello ST") == 6
    assert s.safe_len("hello STO") == 6
    assert s.safe_len("hello STX") == 9
    assert s.safe_len("a <|en") == 2
    assert s.safe_len("") == 0
    assert StopStrings(()).safe_len("anything") == 8


@pytest.fixture(scope="module")
def smol_tokenizer(real_model):
    from edgeinfer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(real_model(SMOL))


def _feed(tok, ids, steps=None, **params) -> tuple[Sequence, list[str]]:
    """Append ids one by one to a fresh Sequence (as generation would), collecting deltas;
    `steps` (a list) receives (text so far, text shown so far) after each token."""
    seq = Sequence(0, tok.encode("Prompt:"), SamplingParams(**params), tok, max_context=4096)
    deltas = []
    for t in ids:
        deltas.append(seq.append(t))
        shown = "".join(deltas)
        assert seq.text.startswith(shown)
        if steps is not None:
            steps.append((seq.text, shown))
        for stop in seq.params.stop:
            assert stop not in shown
        if seq.finished:
            break
    return seq, deltas


TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park."


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT, add_bos=False)
    for stop in ("lazy dog", "over the la", "fox jumps", "day in"):
        assert not any(stop in smol_tokenizer.decode([t]) for t in ids)  # spans tokens
        seq, deltas = _feed(smol_tokenizer, ids, stop=[stop, "never appears"])
        assert seq.finish_reason == "stop"
        assert seq.text == TEXT[: TEXT.index(stop)]
        assert "".join(deltas) == seq.text
        # the tokens up to the one completing the stop string were consumed
        assert seq.num_output_tokens < len(ids)


def test_a_broken_partial_match_is_released(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT, add_bos=False)
    steps = []
    seq, deltas = _feed(smol_tokenizer, ids, steps, stop=["lazy cat", "park. The"])
    assert seq.finish_reason is None  # ran out of input without stopping
    held = [(text, shown) for text, shown in steps if text.endswith("lazy")]
    assert held and all(shown == text[: -len("lazy")] for text, shown in held)
    # "lazy" was held back while it could become "lazy cat", then released; the final "park."
    # could still become "park. The", so it is still held back
    assert "".join(deltas) == TEXT[: TEXT.rindex("park")]
    assert seq.text == TEXT


def test_max_tokens_finishes_with_length(smol_tokenizer):
    ids = smol_tokenizer.encode(TEXT, add_bos=False)
    seq, deltas = _feed(smol_tokenizer, ids, max_tokens=5)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 5
    assert "".join(deltas) == smol_tokenizer.decode(ids[:5])


def test_eos_stops_unless_ignored_and_stop_token_ids(smol_tokenizer):
    tok = smol_tokenizer
    eos = min(tok.eos_ids)
    ids = tok.encode("Hello there", add_bos=False)
    seq, deltas = _feed(tok, [*ids, eos, *ids])
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == [*ids, eos]  # the ending token is kept in token_ids...
    assert seq.text == "".join(deltas) == "Hello there"  # ...but not in the text
    seq, _ = _feed(tok, [*ids, eos, *ids], ignore_eos=True)
    assert seq.finish_reason is None and seq.num_output_tokens == 2 * len(ids) + 1
    seq, _ = _feed(tok, [*ids, *ids], stop_token_ids=[ids[1]])
    assert seq.finish_reason == "stop" and seq.output_token_ids == ids[:2]


def test_context_full_finishes_with_length(smol_tokenizer):
    tok = smol_tokenizer
    prompt = tok.encode("Prompt:")
    seq = Sequence(0, prompt, SamplingParams(), tok, max_context=len(prompt) + 3)
    for t in tok.encode(TEXT, add_bos=False)[:3]:
        seq.append(t)
    assert seq.finish_reason == "length"


# --- LLM on a tiny synthetic model ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(synthetic_model):
    return LLM(str(synthetic_model("llama", "F32")), threads=1)


def test_generate_returns_completions(tiny):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = tiny.generate(["Hello world", "the quick brown fox"], params)
    assert len(out) == 2
    for c, prompt in zip(out, ["Hello world", "the quick brown fox"], strict=True):
        assert c.prompt == prompt
        assert c.finish_reason == "length" and len(c.token_ids) == 12
        assert c.text == tiny.tokenizer.decode(c.token_ids)
        m = c.metrics
        assert m.prompt_tokens == len(c.prompt_token_ids) and m.generated_tokens == 12
        assert m.ttft_s > 0 and m.prefill_tok_s > 0 and m.decode_tok_s > 0
        assert m.prefill_s > 0 and m.decode_s > 0


def test_greedy_first_token_is_argmax_of_logits(tiny):
    ids = tiny.tokenizer.encode("the quick brown fox jumps")
    logits = tiny.logits(ids)
    assert logits.shape == (len(ids), tiny.config.vocab_size) and logits.dtype == np.float32
    c = tiny.generate(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert c.prompt is None and c.prompt_token_ids == ids
    assert c.token_ids[0] == int(np.argmax(logits[-1]))
    # the continuation is greedy all the way: re-running with it appended agrees
    longer = tiny.logits(ids + c.token_ids[:2])
    assert c.token_ids[1:3] == [int(np.argmax(longer[len(ids)])), int(np.argmax(longer[-1]))]


def test_logprobs_are_the_log_softmax_of_the_raw_logits(tiny):
    ids = tiny.tokenizer.encode("the quick brown fox jumps")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=4)
    c = tiny.generate(ids, params)[0]
    logits = tiny.logits(ids + c.token_ids[:-1]).astype(np.float64)[len(ids) - 1 :]
    ref = logits - logits.max(1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(1, keepdims=True))
    assert len(c.logprobs) == len(c.token_ids) == 3
    for lp, token, row in zip(c.logprobs, c.token_ids, ref, strict=True):
        # the engine's decode kernel rounds differently from logits()'s: compare loosely
        assert lp.token_id == token and lp.logprob == pytest.approx(row[token], abs=2e-3)
        assert len(lp.top) == 4 and lp.top[0][0] == token  # greedy takes the most likely
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for t, v in lp.top:
            assert v == pytest.approx(row[t], abs=2e-3)
        assert values[-1] >= np.sort(row)[-4] - 2e-3
    assert tiny.generate(ids, SamplingParams(max_tokens=2))[0].logprobs is None


def test_logits_processors_see_the_output_so_far_and_steer_sampling(tiny):
    seen = []

    def only(token):
        def process(output_ids, logits):
            seen.append(list(output_ids))
            logits[:] = -np.inf
            logits[token] = 0.0
            return logits

        return process

    ids = tiny.tokenizer.encode("Hello world")
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=1, logits_processors=[only(7)])
    c = tiny.generate(ids, params)[0]
    assert c.token_ids == [7, 7, 7, 7]
    assert seen == [[], [7], [7, 7], [7, 7, 7]]
    with pytest.raises(EdgeInferError, match="logits_processors"):
        SamplingParams(logits_processors=[3])
    with pytest.raises(EdgeInferError, match="logprobs"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, stop=["the"]),
    ],
    ids=["greedy", "seeded-stop"],
)
def test_stream_deltas_concatenate_to_generate_text(tiny, params):
    c = tiny.generate("Hello world", params)[0]
    stream = tiny.stream("Hello world", params)
    deltas = list(stream)
    assert "".join(deltas) == c.text
    assert stream.completion.token_ids == c.token_ids
    assert stream.completion.finish_reason == c.finish_reason


def test_seed_reproducible_and_seeds_differ(tiny):
    def run(seed):
        p = SamplingParams(
            temperature=1.5,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=seed,
            max_tokens=24,
            ignore_eos=True,
        )
        return tiny.generate("Hello", p)[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_prompt_longer_than_context_fails_before_compute(tiny):
    blocks = tiny.engine.blocks
    free = blocks.num_free_blocks
    long_ids = [5] * tiny.max_context
    with pytest.raises(PromptError, match="context"):
        tiny.generate(long_ids)
    with pytest.raises(PromptError, match="context"):
        tiny.generate(["ok", "hello " * tiny.max_context])  # nothing runs, not even "ok"
    with pytest.raises(PromptError):
        tiny.logits([5] * (tiny.max_context + 1))
    with pytest.raises(PromptError):
        tiny.generate([[tiny.config.vocab_size]])
    with pytest.raises(PromptError):
        tiny.generate([[]])
    assert blocks.num_free_blocks == free
    assert isinstance(PromptError("x"), EdgeInferError)


def test_stream_closed_early_frees_the_cache(tiny):
    blocks = tiny.engine.blocks
    free = blocks.num_free_blocks
    stream = tiny.stream(
        "Hello world", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    next(stream)
    assert blocks.num_free_blocks < free
    stream.close()
    assert blocks.num_free_blocks == free
    assert not blocks.tables
    done = stream.completion  # what it produced before the close, ended as aborted
    assert done.finish_reason == "abort" and 1 <= len(done.token_ids) < 50


def test_chat_without_template_is_plain_completion(tiny):
    assert tiny.chat_template is None
    msgs = [{"role": "user", "content": "Hello world"}]
    assert tiny.chat_token_ids(msgs) == tiny.tokenizer.encode("Hello world", special=True)
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert tiny.chat(msgs, p)[0].token_ids == tiny.generate("Hello world", p)[0].token_ids
    with pytest.raises(PromptError):
        tiny.chat([{"role": "user"}])
    with pytest.raises(PromptError):
        tiny.chat([])


# --- real models against llama.cpp --------------------------------------------------------------


def llama_greedy(path, prompt_ids, n):
    """llama.cpp's greedy continuation and its logits at each step."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False)
    llm.eval(prompt_ids)
    out, rows = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        out.append(int(np.argmax(row)))
        rows.append(row)
        llm.eval([out[-1]])
    return out, rows


@pytest.mark.parametrize(
    "name, prompt",
    [
        (SMOL, "The capital of France is"),
        ("gemma3-270m", "Once upon a time, in a small village,"),
    ],
)
def test_greedy_generate_matches_llama_cpp(real_model, name, prompt):
    path = real_model(name)
    llm = LLM(str(path), ctx=512)
    n = 24
    c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    theirs, rows = llama_greedy(path, c.prompt_token_ids, n)
    for i, (a, b) in enumerate(zip(c.token_ids, theirs, strict=True)):
        if a != b:
            gap = rows[i][b] - rows[i][a]
            assert gap <= NEAR_TIE, f"token {i}: ours {a}, llama.cpp {b}, logit gap {gap:.3f}"
            break
    else:
        assert len(c.token_ids) == n


@pytest.fixture(scope="module")
def smol(real_model):
    return LLM(str(real_model(SMOL)), ctx=1024)


def test_chat_applies_the_template_like_llama_cpp(smol, real_model):
    llama_cpp = pytest.importorskip("llama_cpp")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    g = llama_cpp.Llama(model_path=str(real_model(SMOL)), vocab_only=True, verbose=False)
    template = g.metadata["tokenizer.chat_template"]
    eos = g.detokenize([g.token_eos()], special=True).decode()
    bos = g.detokenize([g.token_bos()], special=True).decode()
    prompt = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)(messages=msgs).prompt
    expected = g.tokenize(prompt.encode(), add_bos=True, special=True)  # BOS if the model adds one
    assert smol.chat_token_ids(msgs) == expected
    c = smol.chat(msgs, SamplingParams(temperature=0, max_tokens=16))[0]
    assert c.prompt_token_ids == expected and c.text


def test_stream_chat_matches_chat_on_real_model(smol):
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    p = SamplingParams(temperature=0.7, seed=11, max_tokens=16, stop=["."])
    c = smol.chat(msgs, p)[0]
    stream = smol.stream_chat(msgs, p)
    assert "".join(stream) == c.text
    assert "." not in c.text
    assert stream.completion.token_ids == c.token_ids


# ---- cancellation and lazy loading ----------------------------------------------------------


def test_cancel_before_iteration_runs_no_step(tiny):
    stream = tiny.stream("Hello world", SamplingParams(max_tokens=50, ignore_eos=True))
    stream.cancel()
    assert list(stream) == []
    assert stream.sequence.finish_reason == "abort" and stream.sequence.num_output_tokens == 0
    assert tiny.kv_usage()[0] == 0
    with pytest.raises(EdgeInferError, match="cancelled"):
        _ = stream.completion


def test_cancel_from_another_thread_stops_the_iteration(smol):
    import threading

    p = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    stream = smol.stream("Tell me a long story.", p)
    seq = stream.sequence
    # the consumer only iterates: the stop must come from the loop, not from the consumer
    worker = threading.Thread(target=lambda: list(stream))
    worker.start()
    while seq.num_output_tokens < 3 and worker.is_alive():
        worker.join(0.01)
    stream.cancel()
    worker.join(60)
    assert not worker.is_alive()
    assert stream.completion.finish_reason == "abort"
    assert 3 <= seq.num_output_tokens < 500
    assert smol.kv_usage()[0] == 0


def _with_chat_template(src, dst, template: str):
    """Copy a GGUF file with `tokenizer.chat_template` added as its first key.

    The inserted bytes are padded to a multiple of the 32-byte alignment, so the tensor data
    keeps its alignment and its offsets (which are relative to the data section) stay valid.
    """
    import struct

    data = src.read_bytes()
    key = b"tokenizer.chat_template"
    head = struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)  # 8: GGUF string type
    value = template.encode()
    value += b" " * (-(len(head) + 8 + len(value)) % 32)
    kv = head + struct.pack("<Q", len(value)) + value
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    dst.write_bytes(data[:16] + struct.pack("<Q", n_kv + 1) + kv + data[24:])
    return dst


def test_template_that_does_not_compile_fails_only_chat(synthetic_model, tmp_path):
    from edgeinfer.tokenizer.chat_template import ChatTemplateError

    path = _with_chat_template(
        synthetic_model("llama", "F32"), tmp_path / "bad-template.gguf", "{% if %}"
    )
    llm = LLM(str(path), threads=1)  # loading does not need the template
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=2))
    assert out[0].token_ids
    with pytest.raises(ChatTemplateError, match="does not compile"):
        llm.chat([{"role": "user", "content": "hi"}])
