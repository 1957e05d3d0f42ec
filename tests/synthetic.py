"""Tiny random GGUF models for tests: every supported architecture, every quantization type.

The F32 file is written with gguf.GGUFWriter using the tensor names, shapes and metadata that
llama.cpp's loader expects (src/models/<arch>.cpp), then llama.cpp's own quantizer produces
each ftype, so llama-cpp-python can serve as the oracle on exactly the same bytes; the F32
files need no llama.cpp at all. Files are cached under tests/.cache/<generator hash>/ and
reused across runs; any edit to this module, or another gguf (F32) or llama-cpp-python
(quantized files) version, changes the hash and rebuilds them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import tempfile
import zlib
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
FTYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0",
    "Q4_K_M", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K",
)  # fmt: skip
CACHE_ROOT = Path(__file__).parent / ".cache"

SPACE = "\u2581"  # SentencePiece's word-boundary marker


@dataclass(frozen=True)
class Shape:
    # n_embd 256 and n_ff 512: every weight's row length is a multiple of 256, so the K-quants
    # apply to every matrix instead of llama.cpp falling back to legacy types.
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_embd: int = 256
    n_ff: int = 512
    ctx: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tied_output: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None


SHAPES = {
    "llama": Shape(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64),
    # qwen2 ties its head (like Qwen2.5-0.5B) and has q/k/v biases.
    "qwen2": Shape(
        n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, rope_base=1e6, norm_eps=1e-6,
        tied_output=True, qkv_bias=True,
    ),
    # qwen3: head_dim is decoupled from n_embd / n_heads, as in the real models.
    "qwen3": Shape(
        n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128, rope_base=1e6, norm_eps=1e-6,
        qk_norm=True,
    ),
    # gemma3: llama.cpp makes every 6th layer global, so 6 layers give 5 sliding + 1 global; a
    # window of 32 within a 256 context makes the window matter in short tests. One KV head and
    # head_dim * n_heads != n_embd, like Gemma 3 270M.
    "gemma3": Shape(
        n_layers=6, n_heads=4, n_kv_heads=1, head_dim=128, rope_base=1e6, norm_eps=1e-6,
        tied_output=True, qk_norm=True, sliding_window=32,
    ),
}  # fmt: skip

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an had they you were their one all we can her has there been if more when "
    "will would who so no she my me do what up out about time only new some could these two "
    "may first then any like our over such into year your just other how its after also most "
    "Hello hello world model token tokens text test quick brown fox jumps lazy dog The A I"
).split()
_SUBWORDS = (
    "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le "
    "ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ing ion ent tion ly"
).split()
_CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    ".,!?'\"-:;()[]{}/\\@#$%&*+=<>_~`|^"
)


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos: int
    eos: int
    unk: int
    pad: int | None


def build_vocab(arch: str) -> Vocab:
    """A small SentencePiece-style vocab: specials, 256 byte tokens, then scored pieces.

    Every prefix of every word piece is a piece too, so llama.cpp's SPM merges can reach each
    word left to right; shorter pieces score higher, as early BPE merges do.
    """
    t = gguf.TokenType
    if arch == "gemma3":  # Gemma's own order: pad, eos, bos, unk
        specials = [("<pad>", t.CONTROL), ("<eos>", t.CONTROL), ("<bos>", t.CONTROL)]
        specials += [("<unk>", t.UNKNOWN), ("<start_of_turn>", t.CONTROL)]
        specials += [("<end_of_turn>", t.CONTROL)]
        pad, eos, bos, unk = 0, 1, 2, 3
    else:
        specials = [("<unk>", t.UNKNOWN), ("<s>", t.CONTROL), ("</s>", t.CONTROL)]
        specials += [("<|im_start|>", t.CONTROL), ("<|im_end|>", t.CONTROL)]
        pad, eos, bos, unk = None, 2, 1, 0
    tokens = [s for s, _ in specials] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(k) for _, k in specials] + [int(t.BYTE)] * 256
    scores = [0.0] * len(tokens)

    pieces = {SPACE, *_CHARS, *_SUBWORDS}
    for word in _WORDS:
        piece = SPACE + word
        pieces.update(piece[:i] for i in range(2, len(piece) + 1))
    for i, piece in enumerate(sorted(pieces, key=lambda p: (len(p), p))):
        tokens.append(piece)
        types.append(int(t.NORMAL))
        scores.append(-float(i))
    return Vocab(tokens, scores, types, bos, eos, unk, pad)


def _rng(arch: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(arch.encode()))


def _tensors(arch: str, s: Shape, n_vocab: int) -> dict[str, np.ndarray]:
    """Random weights, rows-first (a weight is [out, in]); scales keep activations O(1)."""
    rng = _rng(arch)

    def linear(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        # GGUF stores RMS-norm weights around 1 (the gemma converter already adds its +1).
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    # A tied head computes logits with the embedding, so its scale sets the logits' spread:
    # 2 / sqrt(n_embd) gives logits of a few units (peaked, not one-hot). gemma3 multiplies its
    # input embeddings by sqrt(n_embd), which brings them back to O(1).
    emb_scale = 2.0 / np.sqrt(s.n_embd) if s.tied_output else 1.0
    out: dict[str, np.ndarray] = {
        "token_embd.weight": (rng.standard_normal((n_vocab, s.n_embd)) * emb_scale).astype(
            np.float32
        )
    }
    for i in range(s.n_layers):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = norm(s.n_embd)
        out[p + "attn_q.weight"] = linear(q_dim, s.n_embd)
        out[p + "attn_k.weight"] = linear(kv_dim, s.n_embd)
        out[p + "attn_v.weight"] = linear(kv_dim, s.n_embd)
        if s.qkv_bias:
            for name, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                out[p + f"attn_{name}.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        if s.qk_norm:
            out[p + "attn_q_norm.weight"] = norm(s.head_dim)
            out[p + "attn_k_norm.weight"] = norm(s.head_dim)
        out[p + "attn_output.weight"] = linear(s.n_embd, q_dim)
        if arch == "gemma3":
            out[p + "post_attention_norm.weight"] = norm(s.n_embd)
        out[p + "ffn_norm.weight"] = norm(s.n_embd)
        out[p + "ffn_gate.weight"] = linear(s.n_ff, s.n_embd)
        out[p + "ffn_up.weight"] = linear(s.n_ff, s.n_embd)
        out[p + "ffn_down.weight"] = linear(s.n_embd, s.n_ff)
        if arch == "gemma3":
            out[p + "post_ffw_norm.weight"] = norm(s.n_embd)
    out["output_norm.weight"] = norm(s.n_embd)
    if not s.tied_output:
        # gain 2: logits with a spread of a few units, peaked but not one-hot
        out["output.weight"] = linear(n_vocab, s.n_embd, gain=2.0)
    return out


def write_f32(arch: str, path: Path) -> None:
    """Write the F32 model of `arch` to `path`."""
    s, vocab = SHAPES[arch], build_vocab(arch)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"synthetic-{arch}")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.norm_eps)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if arch == "llama":
        w.add_vocab_size(len(vocab.tokens))

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_unk_token_id(vocab.unk)
    if vocab.pad is not None:
        w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    # Gemma's tokenizer does not prepend a space; Llama-style SentencePiece does.
    w.add_add_space_prefix(arch != "gemma3")

    for name, data in _tensors(arch, s, len(vocab.tokens)).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: Path, dst: Path, ftype: str) -> None:
    """Quantize with llama.cpp's own quantizer (its choices of per-tensor types included)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src.name} -> {ftype} failed with {rc}")


@functools.cache
def generator_key(quantized: bool) -> str:
    """Changes whenever the files this module would write could change."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(f"gguf {version('gguf')}".encode())
    if quantized:
        h.update(f" llama-cpp-python {version('llama-cpp-python')}".encode())
    return h.hexdigest()[:16]


def _atomic(path: Path, write) -> Path:
    """Run write(tmp) and rename tmp to path: concurrent test runs never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def model_path(arch: str, ftype: str, cache_root: Path = CACHE_ROOT) -> Path:
    """The synthetic model file for (arch, ftype), built on first request."""
    if arch not in SHAPES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; choose from {', '.join(FTYPES)}")
    f32 = cache_root / generator_key(quantized=False) / f"{arch}-F32.gguf"
    if not f32.exists():
        _atomic(f32, lambda tmp: write_f32(arch, tmp))
    if ftype == "F32":
        return f32
    out = cache_root / generator_key(quantized=True) / f"{arch}-{ftype}.gguf"
    if not out.exists():
        _atomic(out, lambda tmp: quantize(f32, tmp, ftype))
    return out
