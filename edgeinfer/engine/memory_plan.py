"""Memory plan: what a model needs in RAM for a context length and a number of sequences.

Users run out of memory because the KV cache was never counted, so `edgeinfer info` adds up
weights + KV cache + activations before anything runs, and finds the largest context that fits.

KV cache: every layer stores K (head_dim) and V (v_head_dim) per KV head per token, in 16-token
blocks (so a sequence's tokens round up to whole blocks), at 2 bytes a value (f16), 4 (f32),
34/32 (q8_0: a float16 scale per 32 int8 codes) or 18/32 (q4_0: per 32 4-bit codes).
A sliding-window layer (gemma3) only ever attends to its last `window` tokens, so those layers
keep their cache in a second pool that holds, per sequence, one window and one step's tokens
(`window_blocks_per_seq`; engine.block_manager frees what slid out). `kv_bytes`, `fits` and
`max_ctx` count that; `kv_bytes_every_token` is the cache if every layer kept every token.

Activations (one layer at a time, buffers reused across layers), for a prefill chunk of
T = min(PREFILL_CHUNK, ctx) tokens in float32:
    T × (2·n_embd + q_dim + k_dim + v_dim + attn_out_dim) × 4   residual, norm, q/k/v,
        attention output
  + T × (n_ff + 2·P) × 4                             the FFN's act(gate) * up, beside the gate
        and up of P = min(n_ff, FFN_PIECE_COLS) of its columns at a time (models.base; all
        n_ff of them in a chunk under FFN_PIECES_FROM tokens)
  + T × max(n_embd, attn_out_dim, n_ff) × 4          the int8 GEMM's rounded copy of one
        matmul's input (int16 values, their bytes in lane order, scales and sums per 16)
  + parallel × vocab × 4                             logits of the last position of each sequence
Attention is computed tile by tile over chunks of at most 128 keys (scores of one chunk per
thread), so no [T, ctx] score matrix exists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil

from edgeinfer.config import DEFAULT_CTX, FFN_PIECE_COLS, FFN_PIECES_FROM, PREFILL_CHUNK
from edgeinfer.engine.kv_cache import BLOCK_SIZE, KV_DTYPES, check_kv_dims
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import GGUFFile

ACTIVATION_FORMULA = (
    f"min({PREFILL_CHUNK}, ctx) x (2*n_embd + q_dim + k_dim + v_dim + attn_out_dim + n_ff"
    f" + 2*min(n_ff, {FFN_PIECE_COLS}) + max(n_embd, attn_out_dim, n_ff)) x 4 B"
    " + parallel x vocab x 4 B (logits)"
)


@dataclass(frozen=True)
class MemoryPlan:
    ctx: int  # tokens per sequence
    parallel: int  # sequences
    kv_dtype: str
    weights_bytes: int  # tensor bytes, memory-mapped from the file
    repacked_bytes: int | None  # kernels' load-time copies (None: not estimated)
    kv_bytes_per_token: int  # all layers kept in RAM, one token of one sequence
    sliding_layers: int  # layers that attend only to a window of recent tokens
    sliding_window: int | None
    kv_bytes: int  # ctx × parallel in whole 16-token blocks; sliding layers keep their window
    kv_bytes_every_token: int  # the same if every layer kept every token
    activation_bytes: int
    total_bytes: int
    available_bytes: int  # psutil.virtual_memory().available when planned
    fits: bool
    max_ctx: int  # largest per-sequence context that fits with `parallel` (0: none)
    max_ctx_limit: str  # "memory" or "model" (the trained context length capped it)
    block_tokens: int = BLOCK_SIZE
    prefill_chunk: int = PREFILL_CHUNK
    activation_formula: str = ACTIVATION_FORMULA

    def as_dict(self) -> dict:
        return asdict(self)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def kv_layer_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    t = KV_DTYPES[kv_dtype]
    return cfg.n_kv_heads * (t.row_bytes(cfg.head_dim) + t.row_bytes(cfg.v_head_dim))


def kv_block_bytes(cfg: ModelConfig, kv_dtype: str, n_layers: int | None = None) -> int:
    """One block of the paged cache: BLOCK_SIZE tokens on every layer (or on n_layers)."""
    layers = cfg.n_layers if n_layers is None else n_layers
    return layers * kv_layer_bytes_per_token(cfg, kv_dtype) * BLOCK_SIZE


def window_layers(cfg: ModelConfig, layers: range | list | None = None) -> list[int]:
    """The sliding-window layers among `layers` (default: all)."""
    return [i for i in (range(cfg.n_layers) if layers is None else layers) if cfg.is_sliding(i)]


def window_blocks_per_seq(cfg: ModelConfig, batched_tokens: int) -> int:
    """Most blocks one sequence holds at once in the sliding-window pool: a step whose first
    query is at position p reads from block (p - window + 1) // BLOCK_SIZE on, and writes up to
    batched_tokens tokens from p."""
    return (cfg.sliding_window + batched_tokens - 2) // BLOCK_SIZE + 2


def kv_pools(
    cfg: ModelConfig,
    ctx: int,
    parallel: int,
    kv_dtype: str,
    kv_budget: int | None = None,
    layers: range | list | None = None,
    window: list[int] = (),
    batched_tokens: int = PREFILL_CHUNK,
) -> tuple[int, int]:
    """(blocks of the pool of `layers` but `window`, blocks of the sliding-window pool of the
    `window` layers): ctx x parallel, or kv_budget bytes' worth if given."""
    layers = range(cfg.n_layers) if layers is None else layers
    if kv_budget is None:
        full = _blocks(ctx) * parallel
    else:
        full = kv_budget // kv_block_bytes(cfg, kv_dtype)
    if not window:
        return full, 0
    win = min(full, parallel * window_blocks_per_seq(cfg, batched_tokens))
    n_full = len(layers) - len(window)
    if kv_budget is not None and n_full:  # what the window pool saves buys longer contexts
        layer_block = kv_layer_bytes_per_token(cfg, kv_dtype) * BLOCK_SIZE
        full = max(full, (kv_budget - len(window) * win * layer_block) // (n_full * layer_block))
    return full, win


def draft_sequences(target_blocks: int, ctx: int) -> int:
    """Sequences of ctx tokens a draft model's cache holds (speculative.draft_model): as many
    tokens as the target's full-layer pool of target_blocks blocks, in whole contexts."""
    return max(1, target_blocks * BLOCK_SIZE // ctx)


def n_sliding_layers(cfg: ModelConfig, layers: range | list | None = None) -> int:
    return len(window_layers(cfg, layers))


def kv_bytes(
    cfg: ModelConfig,
    ctx: int,
    parallel: int,
    kv_dtype: str,
    window_capped: bool = True,
    layers: range | list | None = None,
) -> int:
    """KV cache bytes for `parallel` sequences of `ctx` tokens each, in whole blocks, of the
    given layers (default: all; a ggml span's layers keep theirs on its backend); sliding
    layers keep a window each unless window_capped is False."""
    layers = range(cfg.n_layers) if layers is None else layers
    window = window_layers(cfg, layers) if window_capped else []
    full, win = kv_pools(cfg, ctx, parallel, kv_dtype, None, layers, window)
    return kv_pools_bytes(cfg, kv_dtype, len(layers), len(window), full, win)


def kv_pools_bytes(
    cfg: ModelConfig, kv_dtype: str, n_layers: int, n_window: int, full: int, win: int
) -> int:
    """Bytes of the pools kv_pools sized: n_layers layers, n_window of them in the
    sliding-window pool of `win` blocks, the others in the pool of `full` blocks."""
    per_layer_block = kv_layer_bytes_per_token(cfg, kv_dtype) * BLOCK_SIZE
    return ((n_layers - n_window) * full + n_window * win) * per_layer_block


def step_bytes(cfg: ModelConfig, tokens: int, logit_rows: int) -> int:
    """Working memory of one forward pass over `tokens` tokens that returns the logits of
    `logit_rows` of them (one layer's activations at a time, float32)."""
    q_dim = cfg.n_heads * cfg.head_dim
    kv_dim = cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim)
    attn_out_dim = cfg.n_heads * cfg.v_head_dim
    piece = min(cfg.n_ff, FFN_PIECE_COLS) if tokens >= FFN_PIECES_FROM else cfg.n_ff
    per_token = 2 * cfg.n_embd + q_dim + kv_dim + attn_out_dim + cfg.n_ff + 2 * piece
    per_token += max(cfg.n_embd, attn_out_dim, cfg.n_ff)  # the int8 GEMM's input copy
    return tokens * per_token * 4 + logit_rows * cfg.vocab_size * 4


def activation_bytes(cfg: ModelConfig, ctx: int, parallel: int) -> int:
    return step_bytes(cfg, min(PREFILL_CHUNK, ctx), parallel)


def weights_bytes(g: GGUFFile) -> int:
    return sum(t.nbytes for t in g.tensors.values())


def _needed(cfg, fixed: int, ctx: int, parallel: int, kv_dtype: str, layers=None) -> int:
    kv = kv_bytes(cfg, ctx, parallel, kv_dtype, layers=layers)
    return fixed + kv + activation_bytes(cfg, ctx, parallel)


def _max_ctx(
    cfg, fixed: int, parallel: int, kv_dtype: str, available: int, layers=None
) -> tuple[int, str]:
    """Largest ctx (whole blocks, at most the trained context) whose total fits `available`."""
    if _needed(cfg, fixed, cfg.ctx_len, parallel, kv_dtype, layers) <= available:
        return cfg.ctx_len, "model"
    lo, hi = 0, _blocks(cfg.ctx_len)  # in blocks; need(lo) fits (or lo = 0), need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _needed(cfg, fixed, mid * BLOCK_SIZE, parallel, kv_dtype, layers) <= available:
            lo = mid
        else:
            hi = mid
    return lo * BLOCK_SIZE, "memory"


def plan(
    cfg: ModelConfig,
    g: GGUFFile,
    ctx: int | None = None,
    parallel: int = 1,
    kv_dtype: str = "f16",
    repacked_bytes: int | None = None,
    available_bytes: int | None = None,
    host_layers: list[int] | None = None,
) -> MemoryPlan:
    """The memory plan for `parallel` sequences of `ctx` tokens (default: the model's context
    length, at most DEFAULT_CTX); available_bytes defaults to the RAM available now.
    host_layers: the layers whose KV cache is in RAM (default: all; the others are a ggml
    span's, planned on its device by `edgeinfer.ggml.span.SpanExecutor.planned_bytes`)."""
    check_kv_dims(kv_dtype, cfg.head_dim, cfg.v_head_dim)
    ctx = min(cfg.ctx_len, DEFAULT_CTX) if ctx is None else ctx
    if ctx < 1 or parallel < 1:
        raise ValueError("ctx and parallel must be at least 1")
    if available_bytes is None:
        available_bytes = psutil.virtual_memory().available
    weights = weights_bytes(g)
    fixed = weights + (repacked_bytes or 0)
    layers = range(cfg.n_layers) if host_layers is None else host_layers
    kv = kv_bytes(cfg, ctx, parallel, kv_dtype, layers=layers)
    act = activation_bytes(cfg, ctx, parallel)
    total = fixed + kv + act
    max_ctx, limit = _max_ctx(cfg, fixed, parallel, kv_dtype, available_bytes, layers)
    return MemoryPlan(
        ctx=ctx,
        parallel=parallel,
        kv_dtype=kv_dtype,
        weights_bytes=weights,
        repacked_bytes=repacked_bytes,
        kv_bytes_per_token=len(layers) * kv_layer_bytes_per_token(cfg, kv_dtype),
        sliding_layers=n_sliding_layers(cfg, layers),
        sliding_window=cfg.sliding_window,
        kv_bytes=kv,
        kv_bytes_every_token=kv_bytes(cfg, ctx, parallel, kv_dtype, False, layers),
        activation_bytes=act,
        total_bytes=total,
        available_bytes=available_bytes,
        fits=total <= available_bytes,
        max_ctx=max_ctx,
        max_ctx_limit=limit,
    )
