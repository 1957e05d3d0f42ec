"""What a model load needs from a GGUF file, validated: hyperparameters of the architecture (keys
and defaults as llama.cpp reads them), tensor shapes against those hyperparameters, and the
tokenizer arrays and special-token ids against the vocabulary. Everything wrong is one GGUFError,
raised before any kernel sees a weight."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.errors import GGUFError
from edgeinfer.gguf.constants import GGUFValueType
from edgeinfer.gguf.reader import INTEGER_VALUE_TYPES, GGUFFile
from edgeinfer.models import ARCHITECTURES
from edgeinfer.models.layout import tensor_shapes

SUPPORTED_ARCHS = tuple(ARCHITECTURES)  # one model file each
SUPPORTED_TOKENIZERS = ("llama", "gpt2")  # SentencePiece, byte-level BPE
# RoPE scalings the models implement; llama.cpp's others (yarn, longrope) are refused here.
ROPE_SCALING_TYPES = ("none", "linear")
# gemma3: llama.cpp's defaults when the file has no sliding_window_pattern / freq_base_swa.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_ROPE_BASE_LOCAL = 10000.0
DEFAULT_ROPE_BASE = 10000.0
MAX_TOKEN_TYPE = (
    6  # llama.cpp token attributes: undefined, normal, unknown, control, user, unused, byte
)

_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_STRING = frozenset({GGUFValueType.STRING})
_ARRAY = frozenset({GGUFValueType.ARRAY})
_REQUIRED = object()
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # key_length
    v_head_dim: int  # value_length
    n_ff: int
    ctx_len: int  # context_length the model was trained with
    vocab_size: int
    norm_eps: float  # RMS norm epsilon
    rope_base: float  # rope.freq_base (gemma3: the global layers')
    rope_dim: int  # rotated dimensions per head
    rope_scaling: dict[str, Any] | None  # type, factor, original_context_length, ...
    sliding_window: int | None  # gemma3 local layers' window
    rope_base_local: float | None  # gemma3 local layers' rope base
    sliding_pattern: int | None  # gemma3: every n-th layer is global, the others slide
    tied_output: bool  # no output.weight: the head reuses token_embd
    final_logit_softcap: float | None
    attn_scale: float  # multiplies q·k before softmax
    n_params: int  # sum of tensor elements

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelConfig:
        meta = _Meta(g)
        arch = meta.string("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise meta.error(
                "general.architecture",
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})",
            )
        vocab_size = _check_tokenizer(meta, arch)
        hp = _hyperparameters(meta, arch, n_tensors=len(g.tensors))
        config = cls(
            arch=arch,
            name=meta.string("general.name", default=g.path.stem) or g.path.stem,
            vocab_size=vocab_size,
            n_params=sum(t.n_elements for t in g.tensors.values()),
            tied_output="output.weight" not in g.tensors,
            **hp,
        )
        _check_tensors(g, config)
        return config

    def is_sliding(self, layer: int) -> bool:
        """Whether a layer attends within the sliding window (gemma3 local layers)."""
        if self.sliding_window is None:
            return False
        return layer % self.sliding_pattern < self.sliding_pattern - 1


class _Meta:
    """Typed, validated access to metadata; every failure is a GGUFError naming the key."""

    def __init__(self, g: GGUFFile):
        self.g = g

    def error(self, key: str, defect: str) -> GGUFError:
        return GGUFError(self.g.path, f"{key}: {defect}")

    def _typed(self, key: str, allowed: frozenset, what: str, required: bool) -> Any:
        """The value if present and of an allowed type; None if absent and not required."""
        if key not in self.g.metadata:
            if required:
                raise self.error(key, "missing (required)")
            return None
        vtype, _ = self.g.value_types[key]
        if vtype not in allowed:
            raise self.error(key, f"must be {what}, not {vtype.name}")
        return self.g.metadata[key]

    def string(self, key: str, default: Any = _REQUIRED) -> str:
        value = self._typed(key, _STRING, "a string", default is _REQUIRED)
        return default if value is None else value

    def int(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
        value = self._typed(key, INTEGER_VALUE_TYPES, "an integer", default is _REQUIRED)
        if value is None:
            return default
        if value < minimum:
            raise self.error(key, f"{value} is below the minimum {minimum}")
        return value

    def float(self, key: str, default: Any = _REQUIRED, positive: bool = True) -> float:
        value = self._typed(key, _FLOAT_TYPES, "a float", default is _REQUIRED)
        if value is None:
            return default
        if not math.isfinite(value) or (positive and value <= 0):
            sign = " positive" if positive else ""
            raise self.error(key, f"{value} is not a finite{sign} number")
        return float(value)

    def array(self, key: str, etype: GGUFValueType, default: Any = _REQUIRED) -> Any:
        what = f"an array of {etype.name}"
        value = self._typed(key, _ARRAY, what, default is _REQUIRED)
        if value is None:
            return default
        actual = self.g.value_types[key][1]
        if actual != etype:
            raise self.error(key, f"must be {what}, not an array of {actual.name}")
        return value


def _hyperparameters(meta: _Meta, arch: str, n_tensors: int) -> dict[str, Any]:
    k = f"{arch}."
    n_layers = meta.int(k + "block_count")
    # Each block has several tensors: a bigger count is a lie, and bounding it here keeps the
    # per-layer shape checks from looping over billions of phantom layers.
    if n_layers > n_tensors:
        raise meta.error(k + "block_count", f"{n_layers} blocks but only {n_tensors} tensors")
    n_embd = meta.int(k + "embedding_length")
    n_heads = meta.int(k + "attention.head_count")
    n_kv_heads = meta.int(k + "attention.head_count_kv", default=n_heads)
    if n_heads % n_kv_heads:
        raise meta.error(
            k + "attention.head_count_kv",
            f"{n_kv_heads} does not divide attention.head_count {n_heads}",
        )
    head_dim = meta.int(k + "attention.key_length", default=n_embd // n_heads)
    v_head_dim = meta.int(k + "attention.value_length", default=n_embd // n_heads)
    if head_dim < 1 or v_head_dim < 1:
        raise meta.error(k + "attention.head_count", f"{n_heads} heads leave no head dimension")
    rope_dim = meta.int(k + "rope.dimension_count", default=head_dim)
    # llama.cpp refuses partial rotary for llama; everywhere it must be even and fit the head.
    if rope_dim % 2 or rope_dim > head_dim or (arch == "llama" and rope_dim != head_dim):
        raise meta.error(
            k + "rope.dimension_count", f"{rope_dim} does not fit head dimension {head_dim}"
        )
    ctx_len = meta.int(k + "context_length")
    hp = dict(
        n_layers=n_layers,
        n_embd=n_embd,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        n_ff=meta.int(k + "feed_forward_length"),
        ctx_len=ctx_len,
        norm_eps=meta.float(k + "attention.layer_norm_rms_epsilon"),
        rope_base=meta.float(k + "rope.freq_base", default=DEFAULT_ROPE_BASE),
        rope_dim=rope_dim,
        rope_scaling=_rope_scaling(meta, arch, ctx_len),
        attn_scale=1.0 / math.sqrt(head_dim),
        sliding_window=None,
        rope_base_local=None,
        sliding_pattern=None,
        final_logit_softcap=None,
    )
    if arch == "gemma3":
        hp.update(_gemma3(meta, hp))
    return hp


def _gemma3(meta: _Meta, hp: dict[str, Any]) -> dict[str, Any]:
    k = "gemma3."
    out: dict[str, Any] = {}
    cap = meta.float(k + "final_logit_softcapping", default=0.0, positive=False)
    out["final_logit_softcap"] = cap if cap > 0 else None
    # Gemma 3 27B (62 layers) scales queries by 1/sqrt(n_embd / n_heads), the rest by the head dim.
    if hp["n_layers"] == 62:
        out["attn_scale"] = 1.0 / math.sqrt(hp["n_embd"] // hp["n_heads"])
    window = meta.int(k + "attention.sliding_window", default=0, minimum=0)
    if window > 0:
        out["sliding_window"] = window
        out["sliding_pattern"] = meta.int(
            k + "attention.sliding_window_pattern", default=GEMMA3_SLIDING_PATTERN
        )
        out["rope_base_local"] = meta.float(
            k + "rope.freq_base_swa", default=GEMMA3_ROPE_BASE_LOCAL
        )
    return out


def _rope_scaling(meta: _Meta, arch: str, ctx_len: int) -> dict[str, Any] | None:
    """The `{arch}.rope.scaling.*` keys as a dict (prefix dropped), or None when RoPE is plain."""
    prefix = f"{arch}.rope.scaling."
    kind = meta.string(prefix + "type", default="linear")
    if kind not in ROPE_SCALING_TYPES:
        raise meta.error(
            prefix + "type",
            f"RoPE scaling {kind!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)})",
        )
    factor = meta.float(prefix + "factor", default=None)
    if factor is None:
        factor = meta.float(f"{arch}.rope.scale_linear", default=None)  # older key
    if kind == "none" or factor is None or (kind == "linear" and factor == 1.0):
        return None
    scaling: dict[str, Any] = {
        key[len(prefix) :]: value
        for key, value in meta.g.metadata.items()
        if key.startswith(prefix)
    }
    scaling.update(type=kind, factor=factor)
    scaling.setdefault("original_context_length", ctx_len)
    return scaling


def _check_tokenizer(meta: _Meta, arch: str) -> int:
    """Validate the vocabulary arrays and special-token ids; returns the vocabulary size."""
    p = "tokenizer.ggml."
    model = meta.string(p + "model")
    if model not in SUPPORTED_TOKENIZERS:
        raise meta.error(
            p + "model",
            f"unsupported tokenizer {model!r} (supported: {', '.join(SUPPORTED_TOKENIZERS)})",
        )
    tokens = meta.array(p + "tokens", GGUFValueType.STRING)
    vocab_size = len(tokens)
    if vocab_size == 0:
        raise meta.error(p + "tokens", "empty vocabulary")
    declared = meta.int(f"{arch}.vocab_size", default=vocab_size)
    if declared != vocab_size:
        raise meta.error(f"{arch}.vocab_size", f"{declared} but tokenizer has {vocab_size} tokens")
    _check_per_token(meta, p + "scores", GGUFValueType.FLOAT32, vocab_size)
    token_types = _check_per_token(meta, p + "token_type", GGUFValueType.INT32, vocab_size)
    if token_types is not None and len(token_types):
        bad = np.flatnonzero((token_types < 0) | (token_types > MAX_TOKEN_TYPE))
        if len(bad):
            raise meta.error(
                p + "token_type", f"token {bad[0]} has unknown type {token_types[bad[0]]}"
            )
    meta.string(p + "pre", default=None)
    meta.string("tokenizer.chat_template", default=None)
    merges_required = _REQUIRED if model == "gpt2" else None
    meta.array(p + "merges", GGUFValueType.STRING, merges_required)
    for key in meta.g.metadata:
        if key.startswith(p) and key.endswith("_token_id"):
            token_id = meta.int(key, minimum=0)
            if token_id >= vocab_size:
                raise meta.error(
                    key, f"token id {token_id} is outside the vocabulary ({vocab_size})"
                )
    return vocab_size


def _check_per_token(meta: _Meta, key: str, etype: GGUFValueType, vocab_size: int):
    values = meta.array(key, etype, default=None)
    if values is not None and len(values) != vocab_size:
        raise meta.error(key, f"{len(values)} entries for {vocab_size} tokens")
    return values


def _check_tensors(g: GGUFFile, c: ModelConfig) -> None:
    required, optional = tensor_shapes(c)
    for name, info in g.tensors.items():
        expected = required.get(name) or optional.get(name)
        if expected is None:
            raise GGUFError(g.path, f"tensor {name!r}: {_why_unexpected(name, c)}")
        if info.shape != expected:
            raise GGUFError(
                g.path,
                f"tensor {name!r}: shape {info.shape} does not match the metadata {expected}",
            )
    for name in required:
        if name not in g.tensors:
            raise GGUFError(g.path, f"tensor {name!r}: missing (required by {c.arch})")


def _why_unexpected(name: str, c: ModelConfig) -> str:
    m = _BLOCK_RE.match(name)
    if m and int(m.group(1)) >= c.n_layers:
        return f"block {m.group(1)} is beyond {c.arch}.block_count = {c.n_layers}"
    return f"not part of a {c.arch} model"
