"""GGUF models with real architectures' shapes and random weights, for benchmarks at scale.

    python bench/synth.py [NAME ...] [--list] [--dir DIR]     # prints each file's path

Speed does not depend on the weights' values, so a model with Llama-3.2-1B's or Qwen2.5-3B's
shapes and random weights measures what the real one would. Each source is written in F16, one
tensor at a time (never the whole model in memory), with a SentencePiece-style vocabulary of the
real size; llama.cpp's own quantizer then makes each type, so both engines read the same bytes.
Files are cached under $EDGEINFER_HOME/bench-models (default ~/.cache/edgeinfer/bench-models)
and reused; disk: about 2.5 GB (1B) and 6.2 GB (3B) for the F16 sources.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from edgeinfer.eval.quantize import quantize


@dataclass(frozen=True)
class Shape:
    arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    ctx: int
    rope_base: float
    qkv_bias: bool = False
    tied_output: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads


SHAPES = {
    "llama-1b": Shape("llama", 16, 2048, 8192, 32, 8, 128256, 131072, 500000.0, tied_output=True),
    "qwen2.5-3b": Shape(
        "qwen2", 36, 2048, 11008, 16, 2, 151936, 32768, 1e6, qkv_bias=True, tied_output=True
    ),
}
# name -> (shape, llama.cpp ftype)
MODELS = {
    "llama-1b-q4_k_m": ("llama-1b", "Q4_K_M"),
    "llama-1b-q8_0": ("llama-1b", "Q8_0"),
    "qwen2.5-3b-q4_k_m": ("qwen2.5-3b", "Q4_K_M"),
}


def cache_dir() -> Path:
    home = Path(os.environ.get("EDGEINFER_HOME", Path.home() / ".cache" / "edgeinfer"))
    return home / "bench-models"


def _vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """<unk> <s> </s>, the 256 byte tokens, then filler pieces up to n tokens."""
    t = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(t.UNKNOWN), int(t.CONTROL), int(t.CONTROL)] + [int(t.BYTE)] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    for i in range(n - len(tokens)):
        word, k = "", i
        while True:  # a distinct lowercase word per index
            word = letters[k % 26] + word
            k = k // 26 - 1
            if k < 0:
                break
        tokens.append("\u2581" + word)
        types.append(int(t.NORMAL))
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    return tokens, scores, types


def _tensor_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    """name -> numpy shape (rows first), in the order llama.cpp's converter writes them."""
    hd = s.head_dim
    out = {"token_embd.weight": (s.vocab, s.n_embd)}
    for i in range(s.n_layers):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (s.n_embd,)
        out[b + "attn_q.weight"] = (s.n_heads * hd, s.n_embd)
        out[b + "attn_k.weight"] = (s.n_kv_heads * hd, s.n_embd)
        out[b + "attn_v.weight"] = (s.n_kv_heads * hd, s.n_embd)
        if s.qkv_bias:
            out[b + "attn_q.bias"] = (s.n_heads * hd,)
            out[b + "attn_k.bias"] = (s.n_kv_heads * hd,)
            out[b + "attn_v.bias"] = (s.n_kv_heads * hd,)
        out[b + "attn_output.weight"] = (s.n_embd, s.n_heads * hd)
        out[b + "ffn_norm.weight"] = (s.n_embd,)
        out[b + "ffn_gate.weight"] = (s.n_ff, s.n_embd)
        out[b + "ffn_up.weight"] = (s.n_ff, s.n_embd)
        out[b + "ffn_down.weight"] = (s.n_embd, s.n_ff)
    out["output_norm.weight"] = (s.n_embd,)
    if not s.tied_output:
        out["output.weight"] = (s.vocab, s.n_embd)
    return out


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norm weights 1, biases small, matrices scaled by 1/sqrt(in) so activations stay O(1)."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if name.endswith(".bias"):
        return rng.standard_normal(shape, np.float32) * np.float32(0.02)
    out = np.empty(shape, np.float16)
    for lo in range(0, shape[0], 4096):  # in slices: a float32 copy of the whole never exists
        part = rng.standard_normal((min(4096, shape[0] - lo), shape[1]), np.float32)
        out[lo : lo + part.shape[0]] = part * np.float32(1 / np.sqrt(shape[1]))
    return out


def write_f16(s: Shape, name: str, path: Path) -> None:
    tokens, scores, types = _vocab(s.vocab)
    w = gguf.GGUFWriter(path, s.arch)
    w.add_name(name)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(1e-5 if s.arch == "llama" else 1e-6)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    shapes = _tensor_shapes(s)
    for tname, shape in shapes.items():
        dtype = np.float16 if len(shape) == 2 else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(tname, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for tname, shape in shapes.items():
        w.write_tensor_data(_values(tname, shape, rng))
    w.close()


def model_path(name: str, threads: int = os.cpu_count() or 2, root: Path | None = None) -> Path:
    """The file for a name in MODELS, written and quantized on first use."""
    shape_name, ftype = MODELS[name]
    root = root or cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"{shape_name}-F16.gguf"
    if not src.exists():
        print(f"writing {src} ...", file=sys.stderr, flush=True)
        part = src.with_name(f".{src.name}.{os.getpid()}.part")  # renamed once whole
        try:
            write_f16(SHAPES[shape_name], shape_name, part)
            os.replace(part, src)
        finally:
            part.unlink(missing_ok=True)
    out = root / f"{name}.gguf"
    if not out.exists():
        print(f"quantizing {out.name} ...", file=sys.stderr, flush=True)
        quantize(src, out, ftype, threads)  # llama.cpp's quantizer, written atomically
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=list(MODELS), help=", ".join(MODELS))
    ap.add_argument("--list", action="store_true", help="list the names and exit")
    ap.add_argument("--dir", type=Path, default=None, help="cache folder")
    args = ap.parse_args()
    if args.list:
        for name, (shape, ftype) in MODELS.items():
            print(f"{name:<20} {shape} shapes, {ftype}")
        return
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    for name in args.names:
        print(model_path(name, root=args.dir))


if __name__ == "__main__":
    main()
