"""The runtime's knobs, validated once: `LLM`, `AsyncEngine` and the CLI build an `EngineConfig`;
the runner, the engine and the scheduler only read it."""

from __future__ import annotations

from dataclasses import dataclass

from edgeinfer.errors import EdgeInferError

# Longest run of tokens one forward pass processes; longer prompts go in chunks, which bounds
# activation memory (a chunk's K/V are in the cache before the next chunk attends to them).
PREFILL_CHUNK = 512
# A step of FFN_PIECES_FROM rows or more computes the FFN's gate and up FFN_PIECE_COLS columns at
# a time (models.base), so that a prompt's [gate | up] never exists whole: on a 1B model that
# was a step's biggest array (32 MiB at 512 tokens).
FFN_PIECES_FROM = 64
FFN_PIECE_COLS = 2048
# Activation precision: "fast" (int8 prompt rows) or "exact" (float everywhere); see EngineConfig.
PRECISIONS = ("fast", "exact")
# The context used when none is given: the model's, capped (32k-token KV caches surprise people).
DEFAULT_CTX = 4096
# Most draft tokens one speculative step verifies per sequence.
MAX_SPEC_K = 32


class ConfigError(EdgeInferError, ValueError):
    """A runtime knob outside its valid range."""


@dataclass(frozen=True)
class EngineConfig:
    """threads: CPU threads for the kernels (None: the machine's cores).
    ctx: tokens per sequence (None: the model's context length, at most DEFAULT_CTX).
    The KV cache holds `kv_budget` bytes' worth of 16-token blocks if given, else `parallel`
    sequences of ctx tokens, stored as `kv_dtype` ("f16", "f32", or "q8_0" / "q4_0": llama.cpp's
    quantized cache types, edgeinfer.engine.kv_cache).
    A step runs at most `max_num_seqs` sequences and `max_num_batched_tokens` tokens; with
    nothing running, a partial batch waits up to `max_wait_ms` for more requests.
    prefix_caching: reuse the K/V of prompt blocks an earlier request computed.
    batch_invariant: every step takes the row-wise kernels, so a request's tokens are the same
    bits whatever it is batched with (vLLM's batch-invariant mode); otherwise a step of decode
    tokens only takes the fastest kernels for its size (int8 activations at a few sequences).
    precision: "fast" rounds prompt rows' activations to int8 blocks for an integer GEMM where
    the weight type gains by it (the K-quants), as llama.cpp does; "exact" keeps activations
    float everywhere (prompt and decode: the row-wise float kernels, batch-invariant), closest
    to exact math.
    speculative: None (off), "ngram" (prompt lookup) or "draft:MODEL" (a smaller GGUF with the
    target's vocabulary) proposes up to `spec_k` tokens per decoding sequence, verified in one
    step (6: a verify pass of 7 rows stays in the int8 decode kernels of most weight types).
    offload: "LAYERS@BACKEND" (e.g. "12-29@cuda:0", "0-5@cpu", "all@cuda"), a span of layers
    that ggml's backend runs; gpu_layers: llama.cpp's -ngl, the last N layers on cuda (the head
    too when N covers every layer). At most one of them (edgeinfer.ggml.placement). Several
    comma-separated spans may follow one another, e.g. on ggml RPC servers ("8-15@rpc:HOST:PORT").
    rpc: "HOST:PORT[,HOST:PORT...]", ggml RPC servers (`edgeinfer rpc-server`); without offload
    the last gpu_layers layers (all and the head if None) are split among them by free memory.
    """

    threads: int | None = None
    ctx: int | None = None
    parallel: int = 4
    kv_budget: int | None = None
    kv_dtype: str = "f16"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = PREFILL_CHUNK
    max_wait_ms: float = 0.0
    prefix_caching: bool = True
    batch_invariant: bool = False
    precision: str = "fast"
    speculative: str | None = None
    spec_k: int = 6
    offload: str | None = None
    gpu_layers: int | None = None
    rpc: str | None = None

    def __post_init__(self):
        from edgeinfer.engine.kv_cache import check_kv_dtype

        def at_least(name: str, low: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not _is_int(value) or value < low:
                none = "None or " if optional else ""
                raise ConfigError(
                    f"{name} (--{name.replace('_', '-')}) must be {none}an integer >= {low}, "
                    f"got {value!r}"
                )

        at_least("threads", 1, optional=True)
        at_least("ctx", 1, optional=True)
        at_least("parallel", 1)
        at_least("kv_budget", 1, optional=True)
        at_least("max_num_seqs", 1)
        at_least("max_num_batched_tokens", 1)
        if self.max_num_batched_tokens > PREFILL_CHUNK:
            raise ConfigError(
                f"max_num_batched_tokens must be at most {PREFILL_CHUNK}, "
                f"got {self.max_num_batched_tokens}"
            )
        if not isinstance(self.max_wait_ms, (int, float)) or not self.max_wait_ms >= 0:
            raise ConfigError(f"max_wait_ms must be >= 0, got {self.max_wait_ms!r}")
        for name in ("prefix_caching", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_kv_dtype(self.kv_dtype)
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision (--precision) must be one of {', '.join(PRECISIONS)}, "
                f"got {self.precision!r}"
            )
        at_least("spec_k", 1)
        if self.spec_k > MAX_SPEC_K:
            raise ConfigError(f"spec_k (--spec-k) must be at most {MAX_SPEC_K}, got {self.spec_k}")
        spec = self.speculative
        if spec is not None and not (
            spec == "ngram" or (isinstance(spec, str) and spec.startswith("draft:") and spec[6:])
        ):
            raise ConfigError(
                f"speculative (--spec) must be 'ngram' or 'draft:MODEL', got {spec!r}"
            )
        at_least("gpu_layers", 0, optional=True)
        if self.offload is not None:
            from edgeinfer.ggml.placement import check_offload

            if self.gpu_layers:
                raise ConfigError("give either --offload or --gpu-layers, not both")
            if not isinstance(self.offload, str):
                raise ConfigError(f"offload must be a string, got {self.offload!r}")
            check_offload(self.offload)
        if self.rpc is not None:
            from edgeinfer.ggml.placement import check_rpc

            if not isinstance(self.rpc, str):
                raise ConfigError(f"rpc must be a string, got {self.rpc!r}")
            check_rpc(self.rpc)

    @property
    def step_logit_rows(self) -> int:
        """Most rows of logits one step returns: one per sequence that samples (and one per
        draft token it verifies)."""
        per_seq = 1 + (self.spec_k if self.speculative else 0)
        return min(self.max_num_seqs * per_seq, self.max_num_batched_tokens)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
