"""ModelConfig: hyperparameters as llama.cpp reads them, and every inconsistency a GGUFError."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import synthetic
from gguf import GGUFValueType as V
from gguf_craft import Craft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.errors import EdgeInferError, GGUFError
from edgeinfer.gguf.model_config import SUPPORTED_ARCHS, ModelConfig
from edgeinfer.gguf.reader import read_gguf

DROP = object()

# A tiny model: 2 layers, 4 query heads of 8 over n_embd 32, 2 KV heads, vocabulary of 16.
N_EMBD, N_HEADS, N_KV, HEAD_DIM, N_FF, N_LAYERS, VOCAB, CTX = 32, 4, 2, 8, 64, 2, 16, 128


def tiny_metadata(arch: str) -> dict[str, tuple]:
    """key -> (value, type, array element type) of a consistent tiny model."""
    a = f"{arch}."
    return {
        "general.name": ("tiny", V.STRING, None),
        a + "block_count": (N_LAYERS, V.UINT32, None),
        a + "context_length": (CTX, V.UINT32, None),
        a + "embedding_length": (N_EMBD, V.UINT32, None),
        a + "feed_forward_length": (N_FF, V.UINT32, None),
        a + "attention.head_count": (N_HEADS, V.UINT32, None),
        a + "attention.head_count_kv": (N_KV, V.UINT32, None),
        a + "attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32, None),
        a + "rope.freq_base": (10000.0, V.FLOAT32, None),
        "tokenizer.ggml.model": ("llama", V.STRING, None),
        "tokenizer.ggml.tokens": ([f"t{i}" for i in range(VOCAB)], V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": ([-float(i) for i in range(VOCAB)], V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.token_type": ([1] * VOCAB, V.ARRAY, V.INT32),
        "tokenizer.ggml.bos_token_id": (1, V.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, V.UINT32, None),
    }


def tiny_tensors(arch: str) -> dict[str, tuple[int, ...]]:
    """name -> numpy shape (rows first: a weight is (out, in)) of a consistent tiny model."""
    shapes = {"token_embd.weight": (VOCAB, N_EMBD), "output_norm.weight": (N_EMBD,)}
    for i in range(N_LAYERS):
        b = f"blk.{i}."
        shapes.update(
            {
                b + "attn_norm.weight": (N_EMBD,),
                b + "attn_q.weight": (N_HEADS * HEAD_DIM, N_EMBD),
                b + "attn_k.weight": (N_KV * HEAD_DIM, N_EMBD),
                b + "attn_v.weight": (N_KV * HEAD_DIM, N_EMBD),
                b + "attn_output.weight": (N_EMBD, N_HEADS * HEAD_DIM),
                b + "ffn_norm.weight": (N_EMBD,),
                b + "ffn_gate.weight": (N_FF, N_EMBD),
                b + "ffn_up.weight": (N_FF, N_EMBD),
                b + "ffn_down.weight": (N_EMBD, N_FF),
            }
        )
        if arch in ("qwen3", "gemma3"):
            shapes[b + "attn_q_norm.weight"] = (HEAD_DIM,)
            shapes[b + "attn_k_norm.weight"] = (HEAD_DIM,)
        if arch == "gemma3":
            shapes[b + "post_attention_norm.weight"] = (N_EMBD,)
            shapes[b + "post_ffw_norm.weight"] = (N_EMBD,)
    return shapes


def write_tiny(path: Path, arch: str = "llama", meta=None, tensors=None, file_arch=None) -> Path:
    """A tiny model of `arch` with metadata/tensors changed: a value of DROP removes the entry;
    metadata values are (value, type, element type), tensor values are numpy shapes."""
    metadata = {**tiny_metadata(arch), **(meta or {})}
    shapes = {**tiny_tensors(arch), **(tensors or {})}
    w = gguf.GGUFWriter(str(path), file_arch or arch)
    for key, spec in metadata.items():
        if spec is not DROP:
            w.add_key_value(key, *spec)
    for name, shape in shapes.items():
        if shape is not DROP:
            w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def config_of(path: Path) -> ModelConfig:
    return ModelConfig.from_gguf(read_gguf(path))


def expect_error(path: Path, *fragments: str) -> None:
    start = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        config_of(path)
    message = str(info.value)
    assert time.perf_counter() - start < 1.0
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# --- the tiny builder's files ------------------------------------------------------------------


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_tiny_model_config(tmp_path, arch):
    c = config_of(write_tiny(tmp_path / "m.gguf", arch))
    assert (c.arch, c.name, c.n_layers, c.n_embd, c.n_ff) == (arch, "tiny", N_LAYERS, N_EMBD, N_FF)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.v_head_dim) == (
        N_HEADS,
        N_KV,
        HEAD_DIM,
        HEAD_DIM,
    )
    assert (c.ctx_len, c.vocab_size, c.rope_dim, c.rope_base) == (CTX, VOCAB, HEAD_DIM, 10000.0)
    assert c.norm_eps == pytest.approx(1e-6)
    assert c.tied_output and c.rope_scaling is None
    assert c.attn_scale == pytest.approx(1 / math.sqrt(HEAD_DIM))
    assert c.n_params == sum(math.prod(s) for s in tiny_tensors(arch).values())
    assert c.sliding_window is None and not c.is_sliding(0)


def test_defaults_follow_llama_cpp(tmp_path):
    a = "llama."
    meta = {a + "attention.head_count_kv": DROP, a + "rope.freq_base": DROP, "general.name": DROP}
    tensors = {f"blk.{i}.attn_{x}.weight": (N_EMBD, N_EMBD) for i in range(2) for x in "kv"}
    c = config_of(write_tiny(tmp_path / "defaults.gguf", meta=meta, tensors=tensors))
    assert c.n_kv_heads == N_HEADS  # defaults to head_count
    assert c.head_dim == c.v_head_dim == N_EMBD // N_HEADS  # key_length absent
    assert c.rope_base == 10000.0
    assert c.name == "defaults"  # the file stem


def test_untied_output(tmp_path):
    c = config_of(write_tiny(tmp_path / "m.gguf", tensors={"output.weight": (VOCAB, N_EMBD)}))
    assert not c.tied_output


def test_gemma3_sliding_window_defaults(tmp_path):
    meta = {"gemma3.attention.sliding_window": (512, V.UINT32, None)}
    c = config_of(write_tiny(tmp_path / "g.gguf", "gemma3", meta=meta))
    assert (c.sliding_window, c.sliding_pattern, c.rope_base_local) == (512, 6, 10000.0)
    assert [c.is_sliding(i) for i in range(7)] == [True] * 5 + [False, True]
    assert c.final_logit_softcap is None


def test_gemma3_explicit_swa_keys(tmp_path):
    meta = {
        "gemma3.attention.sliding_window": (64, V.UINT32, None),
        "gemma3.attention.sliding_window_pattern": (2, V.UINT32, None),
        "gemma3.rope.freq_base_swa": (5000.0, V.FLOAT32, None),
        "gemma3.final_logit_softcapping": (30.0, V.FLOAT32, None),
    }
    c = config_of(write_tiny(tmp_path / "g.gguf", "gemma3", meta=meta))
    assert (c.sliding_pattern, c.rope_base_local, c.final_logit_softcap) == (2, 5000.0, 30.0)
    assert [c.is_sliding(i) for i in range(4)] == [True, False, True, False]


def test_linear_rope_scaling(tmp_path):
    meta = {
        "llama.rope.scaling.type": ("linear", V.STRING, None),
        "llama.rope.scaling.factor": (4.0, V.FLOAT32, None),
        "llama.rope.scaling.original_context_length": (32, V.UINT32, None),
    }
    c = config_of(write_tiny(tmp_path / "m.gguf", meta=meta))
    assert c.rope_scaling == {"type": "linear", "factor": 4.0, "original_context_length": 32}


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_rope_scalings_the_models_lack_are_refused_by_name(tmp_path, kind):
    meta = {
        "llama.rope.scaling.type": (kind, V.STRING, None),
        "llama.rope.scaling.factor": (4.0, V.FLOAT32, None),
    }
    with pytest.raises(GGUFError, match=f"rope.scaling.type: RoPE scaling '{kind}' is not supp"):
        config_of(write_tiny(tmp_path / "m.gguf", meta=meta))


def test_linear_rope_scaling_from_old_key(tmp_path):
    meta = {"llama.rope.scale_linear": (2.0, V.FLOAT32, None)}
    c = config_of(write_tiny(tmp_path / "m.gguf", meta=meta))
    assert c.rope_scaling == {"type": "linear", "factor": 2.0, "original_context_length": CTX}


def test_optional_tensors_accepted(tmp_path):
    tensors = {
        "rope_freqs.weight": (HEAD_DIM // 2,),
        "blk.0.attn_q.bias": (N_HEADS * HEAD_DIM,),
        "blk.1.attn_output.bias": (N_EMBD,),
    }
    config_of(write_tiny(tmp_path / "m.gguf", tensors=tensors))


# --- negative cases ----------------------------------------------------------------------------


def test_unsupported_architecture_lists_supported(tmp_path):
    path = write_tiny(tmp_path / "m.gguf", file_arch="bert")
    expect_error(path, "general.architecture", "'bert'", "supported: llama, qwen2, qwen3, gemma3")


def test_missing_architecture(tmp_path):
    path = Craft().kv("general.name", V.STRING, "x").write(tmp_path / "m.gguf")
    expect_error(path, "general.architecture: missing")


def test_unsupported_arch_is_a_user_error(tmp_path):
    with pytest.raises(EdgeInferError):
        config_of(write_tiny(tmp_path / "m.gguf", file_arch="mamba"))


@pytest.mark.parametrize(
    "key, spec, fragment",
    [
        ("llama.block_count", DROP, "llama.block_count: missing"),
        ("llama.context_length", DROP, "llama.context_length: missing"),
        ("llama.attention.layer_norm_rms_epsilon", DROP, "layer_norm_rms_epsilon: missing"),
        ("llama.embedding_length", (32.0, V.FLOAT32, None), "must be an integer, not FLOAT32"),
        (
            "llama.attention.head_count",
            ([4, 4], V.ARRAY, V.UINT32),
            "must be an integer, not ARRAY",
        ),
        ("llama.attention.layer_norm_rms_epsilon", ("1e-6", V.STRING, None), "must be a float"),
        ("llama.attention.layer_norm_rms_epsilon", (0.0, V.FLOAT32, None), "finite positive"),
        ("llama.rope.freq_base", (float("nan"), V.FLOAT32, None), "finite positive"),
        ("llama.feed_forward_length", (0, V.UINT32, None), "below the minimum 1"),
        ("llama.attention.head_count_kv", (3, V.UINT32, None), "does not divide"),
        ("llama.attention.head_count", (64, V.UINT32, None), "leave no head dimension"),
        ("llama.rope.dimension_count", (4, V.UINT32, None), "does not fit head dimension 8"),
        ("llama.block_count", (1 << 32, V.UINT64, None), "blocks but only"),
        ("llama.rope.scaling.type", ("weird", V.STRING, None), "'weird' is not supported"),
        ("general.name", (7, V.UINT8, None), "general.name: must be a string"),
    ],
)
def test_bad_metadata(tmp_path, key, spec, fragment):
    expect_error(write_tiny(tmp_path / "m.gguf", meta={key: spec}), fragment)


@pytest.mark.parametrize(
    "tensors, fragment",
    [
        ({"output_norm.weight": DROP}, "'output_norm.weight': missing"),
        ({"blk.1.ffn_up.weight": DROP}, "'blk.1.ffn_up.weight': missing"),
        ({"blk.0.attn_q.weight": (N_EMBD, N_EMBD + 8)}, "'blk.0.attn_q.weight': shape (32, 40)"),
        ({"blk.0.attn_k.weight": (N_HEADS * HEAD_DIM, N_EMBD)}, "'blk.0.attn_k.weight': shape"),
        ({"blk.1.ffn_down.weight": (N_FF, N_EMBD)}, "does not match the metadata (32, 64)"),
        ({"token_embd.weight": (VOCAB + 1, N_EMBD)}, "'token_embd.weight': shape (17, 32)"),
        ({"output.weight": (VOCAB, N_EMBD * 2)}, "'output.weight': shape"),
        ({"blk.0.attn_qkv.weight": (96, N_EMBD)}, "'blk.0.attn_qkv.weight': not part of a llama"),
        ({"blk.2.attn_norm.weight": (N_EMBD,)}, "block 2 is beyond llama.block_count = 2"),
        ({"rope_freqs.weight": (HEAD_DIM,)}, "'rope_freqs.weight': shape (8,)"),
    ],
)
def test_bad_tensors(tmp_path, tensors, fragment):
    expect_error(write_tiny(tmp_path / "m.gguf", tensors=tensors), fragment)


def test_layer_count_larger_than_blocks(tmp_path):
    meta = {"llama.block_count": (3, V.UINT32, None)}
    expect_error(write_tiny(tmp_path / "m.gguf", meta=meta), "'blk.2.attn_norm.weight': missing")


@pytest.mark.parametrize(
    "arch, dropped",
    [
        ("qwen3", "blk.0.attn_q_norm.weight"),
        ("gemma3", "blk.1.post_ffw_norm.weight"),
        ("gemma3", "blk.0.post_attention_norm.weight"),
    ],
)
def test_arch_specific_tensor_missing(tmp_path, arch, dropped):
    path = write_tiny(tmp_path / "m.gguf", arch, tensors={dropped: DROP})
    expect_error(path, f"'{dropped}': missing (required by {arch})")


def test_qk_norm_rejected_for_llama(tmp_path):
    path = write_tiny(tmp_path / "m.gguf", tensors={"blk.0.attn_q_norm.weight": (HEAD_DIM,)})
    expect_error(path, "not part of a llama model")


T = "tokenizer.ggml."


def scalar(value, vtype):
    return (value, vtype, None)


def arr(values, etype):
    return (values, V.ARRAY, etype)


@pytest.mark.parametrize(
    "key, spec, fragment",
    [
        (T + "bos_token_id", scalar(VOCAB, V.UINT32), "bos_token_id: token id 16 is outside"),
        (T + "eos_token_id", scalar(-1, V.INT32), "eos_token_id: -1 is below the minimum 0"),
        (T + "padding_token_id", scalar(99, V.UINT32), "padding_token_id: token id 99"),
        (T + "eot_token_id", scalar("1", V.STRING), "eot_token_id: must be an integer"),
        (T + "tokens", DROP, "tokenizer.ggml.tokens: missing"),
        (T + "tokens", arr(list(range(VOCAB)), V.INT32), "of STRING, not an array of INT32"),
        (T + "tokens", scalar("t0", V.STRING), "tokens: must be an array of STRING, not STRING"),
        (T + "tokens", arr(["t0"] * (VOCAB - 1), V.STRING), "scores: 16 entries for 15 tokens"),
        (T + "scores", arr([0.0] * VOCAB, V.FLOAT64), "scores: must be an array of FLOAT32"),
        (T + "scores", arr([0.0] * 3, V.FLOAT32), "scores: 3 entries for 16 tokens"),
        (T + "token_type", arr([1] * VOCAB, V.UINT8), "token_type: must be an array of INT32"),
        (T + "token_type", arr([1] * 15 + [9], V.INT32), "token 15 has unknown type 9"),
        (T + "model", scalar("bert", V.STRING), "tokenizer 'bert' (supported: llama, gpt2)"),
        (T + "model", DROP, "tokenizer.ggml.model: missing"),
        (T + "model", scalar("gpt2", V.STRING), "tokenizer.ggml.merges: missing"),
        ("llama.vocab_size", scalar(17, V.UINT32), "llama.vocab_size: 17 but tokenizer has 16"),
        ("tokenizer.chat_template", arr(["{{x}}"], V.STRING), "chat_template: must be a string"),
    ],
)
def test_bad_tokenizer_metadata(tmp_path, key, spec, fragment):
    expect_error(write_tiny(tmp_path / "m.gguf", meta={key: spec}), fragment)


def test_empty_vocabulary(tmp_path):
    # gguf.GGUFWriter refuses empty arrays, so this one is crafted.
    craft = Craft().kv("general.architecture", V.STRING, "llama")
    craft.kv(T + "model", V.STRING, "llama").kv_array(T + "tokens", V.STRING, [])
    expect_error(craft.write(tmp_path / "m.gguf"), "tokenizer.ggml.tokens: empty vocabulary")


def test_token_array_too_short_for_embeddings(tmp_path):
    short = [f"t{i}" for i in range(VOCAB - 1)]
    meta = {
        T + "tokens": (short, V.ARRAY, V.STRING),
        T + "scores": DROP,
        T + "token_type": DROP,
    }
    expect_error(write_tiny(tmp_path / "m.gguf", meta=meta), "'token_embd.weight': shape (16, 32)")


def test_gpt2_tokenizer_with_merges(tmp_path):
    meta = {T + "model": ("gpt2", V.STRING, None), T + "merges": (["t 0"], V.ARRAY, V.STRING)}
    assert config_of(write_tiny(tmp_path / "m.gguf", meta=meta)).vocab_size == VOCAB
    meta[T + "merges"] = ([1], V.ARRAY, V.INT32)
    expect_error(write_tiny(tmp_path / "b.gguf", meta=meta), "merges: must be an array of STRING")


# --- the shared synthetic models and llama.cpp as the oracle -----------------------------------


def _llama_cpp_hparams(path: Path) -> dict:
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        return {
            "n_layers": llama_cpp.llama_model_n_layer(model),
            "n_embd": llama_cpp.llama_model_n_embd(model),
            "n_heads": llama_cpp.llama_model_n_head(model),
            "n_kv_heads": llama_cpp.llama_model_n_head_kv(model),
            "ctx_len": llama_cpp.llama_model_n_ctx_train(model),
            "vocab_size": llama_cpp.llama_vocab_n_tokens(vocab),
            "n_params": llama_cpp.llama_model_n_params(model),
            "sliding_window": llama_cpp.llama_model_n_swa(model) or None,
        }
    finally:
        llama_cpp.llama_model_free(model)


def _assert_matches_llama_cpp(path: Path, c: ModelConfig) -> None:
    expected = _llama_cpp_hparams(path)
    ours = {key: getattr(c, key) for key in expected}
    assert ours == expected


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_synthetic_f32_models(synthetic_model, arch):
    path = synthetic_model(arch, "F32")
    c = config_of(path)
    s = synthetic.SHAPES[arch]
    assert (c.arch, c.n_layers) == (arch, s.n_layers)
    assert (c.n_heads, c.n_kv_heads) == (s.n_heads, s.n_kv_heads)
    assert (c.head_dim, c.n_embd, c.n_ff, c.ctx_len) == (s.head_dim, s.n_embd, s.n_ff, s.ctx)
    assert c.vocab_size == len(synthetic.build_vocab(arch).tokens)
    assert c.tied_output == s.tied_output and c.sliding_window == s.sliding_window
    assert c.rope_base == s.rope_base and c.norm_eps == pytest.approx(s.norm_eps)
    reference = gguf.GGUFReader(path)
    assert c.n_params == sum(int(t.n_elements) for t in reference.tensors)
    _assert_matches_llama_cpp(path, c)


@pytest.mark.parametrize(
    "arch, ftype", [("llama", "Q4_K_M"), ("gemma3", "Q2_K"), ("qwen2", "Q5_0")]
)
def test_synthetic_quantized_models(synthetic_model, arch, ftype):
    pytest.importorskip("llama_cpp")
    path = synthetic_model(arch, ftype)
    c = config_of(path)
    assert c == config_of(synthetic_model(arch, "F32"))  # quantizing changes no hyperparameter
    _assert_matches_llama_cpp(path, c)


def _real(real_model, name: str) -> Path:
    try:
        return real_model(name)
    except EdgeInferError as e:  # no network on this machine: nothing to compare against
        pytest.skip(f"cannot fetch {name}: {e}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, arch, expected",
    [
        ("smollm2-135m-instruct", "llama", {"n_layers": 30, "n_embd": 576, "head_dim": 64}),
        (
            "gemma3-270m",
            "gemma3",
            {"n_layers": 18, "n_embd": 640, "head_dim": 256, "sliding_pattern": 6},
        ),
    ],
)
def test_real_models(real_model, name, arch, expected):
    path = _real(real_model, name)
    start = time.perf_counter()
    c = config_of(path)
    assert time.perf_counter() - start < 2.0  # includes Gemma's 262k-token vocabulary
    assert c.arch == arch
    assert {key: getattr(c, key) for key in expected} == expected
    _assert_matches_llama_cpp(path, c)


# --- fuzz: damaged metadata gives a clean GGUFError at model load, never another exception ---


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> tuple[bytes, int]:
    path = write_tiny(tmp_path_factory.mktemp("tiny") / "m.gguf", "gemma3")
    return path.read_bytes(), read_gguf(path).data_offset


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_damaged_metadata(tiny_bytes, data):
    raw, header_len = tiny_bytes
    damaged = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, header_len - 8))
        word = data.draw(st.sampled_from([1, 4, 8]))
        value = data.draw(st.integers(0, 2 ** (8 * word) - 1))
        damaged[pos : pos + word] = value.to_bytes(word, "little")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.gguf"
        path.write_bytes(bytes(damaged))
        start = time.perf_counter()
        try:
            ModelConfig.from_gguf(read_gguf(path))
        except GGUFError as e:
            assert "\n" not in str(e)
        assert time.perf_counter() - start < 1.0
